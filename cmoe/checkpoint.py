"""Exact expert sizes from a local checkpoint's safetensors headers, without loading any weight.

A safetensors file opens with an 8-byte little-endian header length and a JSON header that gives
each tensor's dtype, shape and byte range, so the bytes of every expert tensor are known from a
few kilobytes of reading. Names understood (layer L, expert E):

- per expert, original checkpoints and what transformers 5 saves:
  `model.layers.L.block_sparse_moe.experts.E.w1.weight` (Mixtral) and
  `model.layers.L.mlp.experts.E.gate_proj.weight` (DeepSeek, Qwen, OLMoE), with any suffix a
  quantizer writes (`qweight`, `qzeros`, `scales`, `g_idx`, `weight_scale`, ...);
- fused, as transformers 5 holds them in memory: `model.layers.L.mlp.experts.gate_up_proj`
  [E, 2F, H] and `down_proj` [E, H, F] (and their quantized companions), split evenly by E.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from cmoe.errors import CmoeError
from cmoe.spec import ModelSpec

_PER_EXPERT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(.+)$")
_FUSED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:[._](.+))?$")
_CANON = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_header(path: Path) -> dict:
    """The JSON header of one .safetensors file (tensor name -> dtype, shape, data_offsets)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CmoeError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise CmoeError(f"{path} is not a safetensors file (header length {n} is absurd)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CmoeError(f"{path} has a corrupted safetensors header: re-save the checkpoint") from None
    header.pop("__metadata__", None)
    return header


def tensor_nbytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


def safetensors_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not allow_pickle:
        raise CmoeError(f"{model_dir} holds only pickle weights ({pickles[0].name}); pickle files can run "
                        f"code when loaded: convert to safetensors, or pass --allow-pickle if you trust them")
    if not pickles:
        raise CmoeError(f"{model_dir} has no weight files (*.safetensors)")
    return []


def checkpoint_expert_tensors(model_dir: Path, spec: ModelSpec) -> list[list[dict[str, int]]]:
    """Bytes of every stored tensor of every routed expert: [moe_layer][expert] -> {'w1.qweight': n}."""
    moe_index = {d: m for m, d in enumerate(spec.moe_layers)}
    out: list[list[dict[str, int]]] = [[{} for _ in range(spec.num_experts)] for _ in spec.moe_layers]
    for path in safetensors_files(model_dir):
        for name, entry in read_header(path).items():
            if m := _PER_EXPERT.match(name):
                layer, e, w, suffix = int(m.group(1)), int(m.group(2)), _CANON[m.group(3)], m.group(4)
                if layer in moe_index and e < spec.num_experts:
                    out[moe_index[layer]][e][f"{w}.{suffix}"] = tensor_nbytes(entry)
            elif m := _FUSED.match(name):
                layer, which, suffix = int(m.group(1)), m.group(2), m.group(3) or "weight"
                if layer not in moe_index:
                    continue
                n = tensor_nbytes(entry)
                if entry["shape"][0] != spec.num_experts or n % spec.num_experts:
                    raise CmoeError(f"{path.name}: fused tensor {name} does not split into {spec.num_experts} experts")
                for e in range(spec.num_experts):
                    out[moe_index[layer]][e][f"{which}.{suffix}"] = n // spec.num_experts
    missing = [(spec.moe_layers[m], e) for m, row in enumerate(out) for e, t in enumerate(row) if not t]
    if missing:
        layer, e = missing[0]
        raise CmoeError(f"{model_dir}: no tensors found for expert {e} of layer {layer} "
                        f"({len(missing)} experts missing): is config.json from this checkpoint?")
    return out


def checkpoint_expert_bytes(model_dir: Path, spec: ModelSpec) -> list[list[int]]:
    return [[sum(t.values()) for t in row] for row in checkpoint_expert_tensors(model_dir, spec)]


_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "I8": "w8a8"}


def detect_expert_format(model_dir: Path, spec: ModelSpec) -> str:
    """The storage format of the first expert's w1, as a cmoe format name (see cmoe.quant)."""
    d = spec.moe_layers[0]
    f, h = spec.expert_ffn, spec.hidden
    found: dict[str, dict] = {}
    for path in safetensors_files(model_dir):
        for name, entry in read_header(path).items():
            m = _PER_EXPERT.match(name)
            if m and int(m.group(1)) == d and m.group(2) == "0" and _CANON[m.group(3)] == "w1":
                found[m.group(4)] = entry
            elif (m := _FUSED.match(name)) and int(m.group(1)) == d and m.group(2) == "gate_up_proj":
                found[m.group(3) or "weight"] = entry
    if "qweight" in found and "scales" in found:
        q, sc = found["qweight"]["shape"], found["scales"]["shape"]
        group = h // sc[0]
        if q[0] * 32 % h == 0 and q[1] == f:            # GPTQ: [in*b/32, out]
            return f"gptq-w{q[0] * 32 // h}g{group}"
        return f"awq-w{q[1] * 32 // f}g{group}"         # AWQ: [in, out*b/32]
    if "weight" in found:
        return _PLAIN.get(found["weight"]["dtype"], "bf16")
    raise CmoeError(f"{model_dir}: cannot tell how the experts of layer {d} are stored")
