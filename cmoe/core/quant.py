"""Quantization recipes and the exact byte size of every tensor of every expert.

Floor 1: plain data and arithmetic, no torch. A *format* is how one weight matrix is stored:

| format         | stored tensors (for a matrix of shape out x in)                                 |
| ---            | ---                                                                             |
| `bf16`         | weight bf16 [out, in]                                                           |
| `w8a8`         | weight int8 [out, in], weight_scale bf16 [out] (activations scaled per token)   |
| `w{b}g{g}`     | qweight packed b-bit [out * in * b / 8 bytes], scales_and_zeros bf16 [in/g, out, 2]: the layout of torch's `_weight_int4pack_mm`, which the executor runs |
| `w{b}g{g}-fp16`| the same bytes, the pairs fp16 (scale, zero point): how the executor holds GPTQ and AWQ experts as stored |
| `gptq-w{b}g{g}`| qweight int32 [in*b/32, out], qzeros int32 [in/g, out*b/32], scales fp16 [in/g, out], g_idx int32 [in] |
| `awq-w{b}g{g}` | qweight int32 [in, out*b/32], qzeros int32 [in/g, out*b/32], scales fp16 [in/g, out] |
| `ct-w{b}g{g}`  | compressed-tensors pack-quantized, symmetric: weight_packed int32 [out, in*b/32], weight_scale bf16 [out, in/g], weight_shape int64 [2] |
| `fp8`          | weight fp8 [out, in], weight_scale fp32 [1] (per tensor)                       |
| `fp8-ch`       | weight fp8 [out, in], weight_scale fp32 [out, 1] (per output channel)          |
| `fp8-b{B}`     | weight fp8 [out, in], weight_scale_inv fp32 [out/B, in/B] (B x B blocks, DeepSeek-V3 style) |
| `bnb-int8`     | bitsandbytes LLM.int8: weight int8 [out, in], SCB fp32 [out]                    |

The checkpoint formats (`ct-`, `fp8`, `bnb-int8`) describe what `cmoe trace --quant checkpoint`
finds in a quantized checkpoint; `cmoe.core.checkpoint` checks that these sizes are the stored ones.

A recipe names one format for attention, one for dense weights (shared experts, dense MLPs,
embeddings, head) and the formats of the routed experts. A *mixed* recipe gives a fraction of
each block's experts another format, as mixed-precision MoE checkpoints do; which experts get
which format is a seeded permutation per block, so the same recipe always gives the same sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from cmoe.core.errors import CmoeError
from cmoe.core.spec import ModelSpec

_GROUPED = re.compile(r"^(?:(gptq|awq|ct)-)?w([1-8])g(\d+)(-fp16)?$")
_FP8 = re.compile(r"^fp8(?:-(ch)|-b(\d+))?$")
BASIC_FORMATS = ("bf16", "fp16", "fp32", "w8a8", "bnb-int8")


def is_format(fmt: str) -> bool:
    m = _GROUPED.match(fmt)
    return fmt in BASIC_FORMATS or bool(m and not (m.group(1) and m.group(4))) or bool(_FP8.match(fmt))


def check_format(fmt: str) -> str:
    if is_format(fmt):
        return fmt
    raise CmoeError(f"unknown quantization format '{fmt}': use bf16, w8a8, w<bits>g<group> "
                    f"(e.g. w4g128), gptq-w4g128, awq-w4g128, ct-w4g128, fp8, fp8-ch, fp8-b128 or bnb-int8")


def format_bits(fmt: str) -> float:
    """Nominal bits per weight (without scales), for tables."""
    if fmt in ("bf16", "fp16"):
        return 16
    if fmt == "fp32":
        return 32
    if fmt in ("w8a8", "bnb-int8") or _FP8.match(fmt):
        return 8
    return int(_GROUPED.match(fmt).group(2))


def tensor_bytes(fmt: str, out: int, inp: int) -> dict[str, int]:
    """Stored tensors of one (out x in) matrix in `fmt`, as suffix -> bytes, exact."""
    if fmt in ("bf16", "fp16"):
        return {"weight": out * inp * 2}
    if fmt == "fp32":
        return {"weight": out * inp * 4}
    if fmt == "w8a8":
        return {"weight": out * inp, "weight_scale": out * 2}
    if fmt == "bnb-int8":
        return {"weight": out * inp, "SCB": out * 4}
    if f8 := _FP8.match(fmt):
        return {"weight": out * inp, **_fp8_scales(f8, out, inp)}
    m = _GROUPED.match(check_format(fmt))
    style, bits, group = m.group(1), int(m.group(2)), int(m.group(3))
    groups = math.ceil(inp / group)
    if style is None:
        return {"qweight": math.ceil(out * inp * bits / 8), "scales_and_zeros": groups * out * 2 * 2}
    if style == "ct":
        return {"weight_packed": out * 4 * math.ceil(inp * bits / 32), "weight_scale": out * groups * 2,
                "weight_shape": 2 * 8}
    words = 4 * math.ceil(out * bits / 32)             # int32 words holding one row of packed zeros
    packed_zeros = groups * words
    scales = groups * out * 2
    if style == "gptq":
        return {"qweight": 4 * math.ceil(inp * bits / 32) * out, "qzeros": packed_zeros,
                "scales": scales, "g_idx": inp * 4}
    return {"qweight": inp * words, "qzeros": packed_zeros, "scales": scales}


def _fp8_scales(m: re.Match, out: int, inp: int) -> dict[str, int]:
    if m.group(1):                                     # per output channel
        return {"weight_scale": out * 4}
    if m.group(2):                                     # B x B blocks
        b = int(m.group(2))
        return {"weight_scale_inv": math.ceil(out / b) * math.ceil(inp / b) * 4}
    return {"weight_scale": 4}


def matrix_bytes(fmt: str, out: int, inp: int) -> int:
    return sum(tensor_bytes(fmt, out, inp).values())


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    expert: str = "w4g128"                         # format of most routed experts
    attention: str = "w8a8"
    dense: str = "bf16"                            # shared experts, dense MLPs, embeddings, head
    mixed: tuple[tuple[str, float], ...] = ()      # (format, fraction of each block's experts)
    seed: int = 0

    def __post_init__(self) -> None:
        for f in (self.expert, self.attention, self.dense, *(f for f, _ in self.mixed)):
            check_format(f)
        total = sum(fr for _, fr in self.mixed)
        if any(fr < 0 for _, fr in self.mixed) or total > 1:
            raise CmoeError(f"recipe {self.name}: mixed fractions must be >= 0 and sum to at most 1, got {total}")

    def expert_formats(self, num_experts: int, moe_layer: int) -> list[str]:
        """Format of each routed expert of one MoE block (seeded, stable)."""
        fmts = [self.expert] * num_experts
        if not self.mixed:
            return fmts
        order = np.random.default_rng([self.seed, moe_layer]).permutation(num_experts)
        pos = 0
        for fmt, frac in self.mixed:
            n = int(round(frac * num_experts))
            for e in order[pos:pos + n]:
                fmts[int(e)] = fmt
            pos += n
        return fmts

    def to_dict(self) -> dict:
        return {"name": self.name, "expert": self.expert, "attention": self.attention,
                "dense": self.dense, "mixed": [list(m) for m in self.mixed], "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantRecipe":
        return cls(name=d["name"], expert=d["expert"], attention=d["attention"], dense=d["dense"],
                   mixed=tuple((f, float(fr)) for f, fr in d.get("mixed", [])), seed=d.get("seed", 0))


RECIPES: dict[str, QuantRecipe] = {
    "bf16": QuantRecipe("bf16", expert="bf16", attention="bf16"),
    "w4a16": QuantRecipe("w4a16", expert="w4g128", attention="w8a8"),
    "w8a16": QuantRecipe("w8a16", expert="w8g128", attention="w8a8"),
    # a quarter of each block's experts at 8 bits, a quarter at 3 bits, the rest at 4 bits
    "mixed": QuantRecipe("mixed", expert="w4g128", attention="w8a8",
                         mixed=(("w8g128", 0.25), ("w3g128", 0.25))),
    "gptq-w4": QuantRecipe("gptq-w4", expert="gptq-w4g128", attention="bf16"),
}


def recipe(spec: str) -> QuantRecipe:
    """A recipe by preset name, or `EXPERT[+FMT:FRACTION...][,attention=FMT][,dense=FMT]`."""
    if spec in RECIPES:
        return RECIPES[spec]
    parts = spec.split(",")
    kw: dict = {}
    for p in parts[1:]:
        key, _, val = p.partition("=")
        if key not in ("attention", "dense") or not val:
            raise CmoeError(f"bad recipe part '{p}': write attention=FMT or dense=FMT")
        kw[key] = val
    head, *extra = parts[0].split("+")
    mixed = []
    for x in extra:
        fmt, _, frac = x.partition(":")
        try:
            mixed.append((fmt, float(frac)))
        except ValueError:
            raise CmoeError(f"bad mixed part '{x}': write FORMAT:FRACTION, e.g. w8g128:0.25") from None
    if not is_format(head):
        raise CmoeError(f"unknown recipe '{spec}': use one of {', '.join(RECIPES)} or a format like w4g128")
    return QuantRecipe(spec, expert=head, mixed=tuple(mixed), **kw)


# --- bytes of a whole model ---------------------------------------------------------------------

def expert_tensor_bytes(spec: ModelSpec, fmt: str) -> dict[str, int]:
    """One expert in `fmt` as 'w1.qweight' -> bytes."""
    return {f"{w}.{s}": b for w, (o, i) in spec.expert_shapes().items()
            for s, b in tensor_bytes(fmt, o, i).items()}


def expert_bytes(spec: ModelSpec, rec: QuantRecipe) -> list[list[int]]:
    """Bytes of every routed expert: [moe_layer][expert]."""
    cache: dict[str, int] = {}
    out = []
    for m in range(spec.num_moe_layers):
        row = []
        for fmt in rec.expert_formats(spec.num_experts, m):
            if fmt not in cache:
                cache[fmt] = sum(expert_tensor_bytes(spec, fmt).values())
            row.append(cache[fmt])
        out.append(row)
    return out


def non_expert_bytes(spec: ModelSpec, rec: QuantRecipe) -> dict[str, int]:
    """Weights that stay resident on the GPU, by part (exact, norms and router included)."""
    h = spec.hidden
    attn = sum(matrix_bytes(rec.attention, o, i) for o, i in spec.attention_shapes().values())
    if spec.qkv_bias:
        attn += (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * 2
    norms = 2 * h * 2
    router = spec.num_experts * h * 2
    shared = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.shared_ffn).values()) \
        if spec.shared_ffn else 0
    dense = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.dense_ffn).values()) \
        if spec.dense_ffn else 0
    embed = spec.vocab * h * 2
    return {"attention": attn * spec.num_layers, "norms": norms * spec.num_layers + h * 2,
            "router": router * spec.num_moe_layers, "shared_experts": shared * spec.num_moe_layers,
            "dense_mlp": dense * len(spec.dense_layers),
            "embeddings": embed if spec.tie_embeddings else 2 * embed}
