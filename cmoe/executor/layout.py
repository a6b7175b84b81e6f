"""Byte layout of one expert inside its slot. Pure arithmetic, no torch (floor 2).

An expert is one contiguous byte buffer holding its matrices in the form the kernel reads, so a
load is a single copy. Gate and up projections are fused into one [2F, H] matrix (gate rows
first, as transformers 5 fuses them), which saves a kernel launch per expert:

| format      | parts, in order                                                                 |
| ---         | ---                                                                             |
| `w4g{g}`    | w13 int4 packed [2F*H/2 B], w13 scales_and_zeros bf16 [H/g, 2F, 2], w2 packed [H*F/2 B], w2 scales_and_zeros bf16 [F/g, H, 2] |
| `w4g{g}-fp16` | the same parts and sizes, the pairs fp16 (scale, zero point) instead of bf16 (scale, zero) |
| `bf16`      | w13 bf16 [2F, H], w2 bf16 [H, F]                                                |
| `fp32`      | w13 fp32 [2F, H], w2 fp32 [H, F] (CPU reference runs)                           |

The int4 packing is device specific (torch's CUDA tinygemm layout, or its CPU twin); both take
F*H/2 bytes per matrix, so the slot size is the same on either device and equals the byte count
`cmoe.core.quant` gives for the format: the simulator and the executor size the pool identically.
Every part starts on a 16-byte boundary (vector loads); with real model shapes no padding falls
between parts.

Why `-fp16`: GPTQ and AWQ checkpoints store fp16 scales s and integer zero points z, w = (q - z) * s.
Neither s nor the bf16 layout's zero term (8 - z) * s fits bf16 in general, but (s, z) fits fp16
exactly, in the same two bytes each, so those experts run as stored with the slot size unchanged.
Each kernel turns a pair into fp32 (s, (8 - z) * s), which is exact (an 11-bit mantissa times a
5-bit integer), and then computes as for `w4g{g}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cmoe.core.errors import CmoeError
from cmoe.core.padding import align

_INT4 = re.compile(r"^w4g(\d+)(-fp16)?$")
PART_ALIGN = 16
FORMATS = ("w4g32", "w4g64", "w4g128", "w4g256", "bf16", "fp32",
           "w4g32-fp16", "w4g64-fp16", "w4g128-fp16", "w4g256-fp16")


@dataclass(frozen=True)
class Part:
    name: str            # w13, w13_sz, w2, w2_sz
    offset: int
    nbytes: int
    shape: tuple[int, int]   # the logical matrix (out, in) this part belongs to


@dataclass(frozen=True)
class ExpertLayout:
    fmt: str
    hidden: int
    ffn: int
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        last = self.parts[-1]
        return last.offset + last.nbytes

    @property
    def group(self) -> int:
        m = _INT4.match(self.fmt)
        return int(m.group(1)) if m else 0

    @property
    def zero_point(self) -> bool:
        """The int4 pairs are fp16 (scale, zero point), not bf16 (scale, zero): a `-fp16` format."""
        return self.fmt.endswith("-fp16")

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)


def inner_k_tiles(k: int) -> int:
    """The largest tile count torch's int4 packing accepts for in-features k."""
    for t in (8, 4, 2):
        if k % (t * 16) == 0:
            return t
    raise CmoeError(f"int4 experts need in-features that are a multiple of 32, got {k}: use --quant bf16")


def check_int4(out: int, inp: int, group: int) -> None:
    if group not in (32, 64, 128, 256):
        raise CmoeError(f"int4 group size must be 32, 64, 128 or 256, got {group}")
    if inp % group or inp % 32:
        raise CmoeError(f"int4 experts need in-features ({inp}) divisible by the group size {group} and by 32: "
                        f"use a smaller group (w4g32) or --quant bf16")
    if out % 64:
        raise CmoeError(f"int4 experts need out-features divisible by 64, got {out}: use --quant bf16")


def expert_layout(fmt: str, hidden: int, ffn: int) -> ExpertLayout:
    m = _INT4.match(fmt)
    if m is None and fmt not in ("bf16", "fp32"):
        raise CmoeError(f"the executor runs experts as w4g32/w4g64/w4g128/w4g256, bf16 or fp32, not '{fmt}': "
                        f"pick one with --quant (mixed-bit and GPTQ recipes are simulator-only for now)")
    mats = (("w13", (2 * ffn, hidden)), ("w2", (hidden, ffn)))
    sizes: list[tuple[str, int, tuple[int, int]]] = []
    for name, (o, i) in mats:
        if m:
            g = int(m.group(1))
            check_int4(o, i, g)
            sizes += [(name, o * i // 2, (o, i)), (f"{name}_sz", (i // g) * o * 2 * 2, (o, i))]
        else:
            sizes.append((name, o * i * (2 if fmt == "bf16" else 4), (o, i)))
    parts, off = [], 0
    for name, n, shape in sizes:
        off = align(off, PART_ALIGN)
        parts.append(Part(name, off, n, shape))
        off += n
    return ExpertLayout(fmt, hidden, ffn, tuple(parts))


def slot_size(layout: ExpertLayout) -> int:
    return align(layout.nbytes)
