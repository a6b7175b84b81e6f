"""Expert weights in kernel form, and the expert FFN on a slot. Torch only.

Int4 follows torch's tinygemm convention (`_weight_int4pack_mm` on CUDA, `_weight_int4pack_mm_for_cpu`
on CPU): per group of g input features, w = (q - 8) * scale + zero with q in 0..15, scales and
zeros stored as bf16 [in/g, out, 2]. Both packings go through torch's own converters: the CPU
layout depends on the CPU's instruction set (blocks of 64 output rows with AVX-512, 32 with AVX2),
so a hand-written copy of it is right on one machine and silently wrong on the other. Codes made
on the GPU for a CPU twin travel to the host to be packed there, by the kernel that will read them.

`-fp16` formats (GPTQ, AWQ as stored) hold fp16 (scale, zero point) pairs, w = (q - z) * s. torch's
CPU kernel takes scales of the activations' dtype only, so it gets fp32 (s, (8 - z) * s), made per
call from the pairs (exact; a few elements per group of g weights) and fp32 activations. torch's
CUDA kernel reads bf16 pairs only: those formats are refused there (the Triton layer kernel
reads them, `cmoe.executor.moe_kernel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cmoe.core.errors import CmoeError
from cmoe.executor.layout import ExpertLayout, inner_k_tiles


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> codes int32 [out, in] in 0..15, scales_and_zeros bf16 [in/g, out, 2]."""
    o, i = w.shape
    g = w.float().reshape(o, i // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo).clamp(min=1e-8) / 15).to(torch.bfloat16).float()
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(o, i)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return codes, sz


def quantize_zp(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> codes int32 [out, in] in 0..15, fp16 (scale, zero point) [in/g, out, 2]
    (asymmetric round to nearest, as GPTQ and AWQ store it), for a `-fp16` format."""
    o, i = w.shape
    g = w.float().reshape(o, i // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=2 ** -14).to(torch.float16).float()
    zp = (-lo / scale).round().clamp(0, 15)
    codes = ((g / scale[..., None]).round() + zp[..., None]).clamp(0, 15).to(torch.int32).reshape(o, i)
    return codes, torch.stack([scale, zp], -1).transpose(0, 1).contiguous().to(torch.float16)


def affine_pairs(sz: torch.Tensor) -> torch.Tensor:
    """fp16 (scale, zero point) pairs -> fp32 (scale, zero) pairs of the kernels' w = (q - 8) * s + z:
    z = (8 - zp) * s, exact in fp32 (an 11-bit mantissa times an integer below 32)."""
    s, zp = sz.float().unbind(-1)
    return torch.stack([s, (8 - zp) * s], -1)


def dequantize(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The weights [out, in] in fp32, exactly: bf16 pairs (scale, zero), or fp16 (scale, zero point)."""
    o, i = codes.shape
    if sz.dtype == torch.float16:
        s, zp = sz.float()[..., 0].T, sz.float()[..., 1].T
        return ((codes.float().reshape(o, i // group, group) - zp[..., None]) * s[..., None]).reshape(o, i)
    s, z = sz.float()[..., 0].T, sz.float()[..., 1].T                   # [out, in/g]
    return ((codes.float().reshape(o, i // group, group) - 8) * s[..., None] + z[..., None]).reshape(o, i)


def pack_cuda(codes: torch.Tensor) -> torch.Tensor:
    """codes int32 [out, in] on a CUDA device -> torch's tinygemm int4 layout (int32, 4-d)."""
    nib = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(nib, inner_k_tiles(codes.shape[1]))


def pack_cpu(codes: torch.Tensor) -> torch.Tensor:
    """codes int32 [out, in] on any device -> this CPU's int4 layout, uint8 [out, in/2] on the host,
    by torch's own converter (its layout follows the CPU's instruction set)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to("cpu", torch.int32).contiguous(), 2)


def packed_shape(device_type: str, out: int, inp: int) -> tuple[torch.dtype, tuple[int, ...]]:
    if device_type == "cuda":
        t = inner_k_tiles(inp)
        return torch.int32, (out // 8, inp // (t * 16), 32, t // 2)
    return torch.uint8, (out, inp // 2)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)
    if sz.dtype == torch.float16:           # a -fp16 format: exact fp32 pairs, fp32 activations
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.float(), packed, group, affine_pairs(sz)).to(x.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz if x.dtype == torch.bfloat16 else sz.to(x.dtype))


def sz_dtype(layout: ExpertLayout) -> torch.dtype:
    return torch.float16 if layout.zero_point else torch.bfloat16


def _part(out: torch.Tensor, layout: ExpertLayout, name: str) -> torch.Tensor:
    p = layout.part(name)
    return out[p.offset: p.offset + p.nbytes]


def write_int4(out: torch.Tensor, layout: ExpertLayout, name: str, codes: torch.Tensor, sz: torch.Tensor,
               device_type: str) -> None:
    """Matrix `name` of an expert, as codes and scales, into its slot bytes in a packing: "cuda"
    (torch's CUDA int4 kernel), "cpu" (its CPU kernel) or "tiled" (`cmoe.executor.moe_kernel`'s
    layer kernel, on either device). sz is bf16 (scale, zero), or fp16 (scale, zero point) for a
    `-fp16` layout."""
    want = sz_dtype(layout)
    assert sz.dtype == want, f"{layout.fmt} holds {want} scale pairs, got {sz.dtype}"
    if device_type == "cuda" and layout.zero_point:
        raise CmoeError(cuda_refusal(layout.fmt))
    if device_type == "tiled":
        packed = pack_tiled(codes)
    else:
        packed = pack_cuda(codes) if device_type == "cuda" else pack_cpu(codes)
    _part(out, layout, name).copy_(packed.reshape(-1).view(torch.uint8))
    _part(out, layout, f"{name}_sz").copy_(sz.reshape(-1).view(torch.uint8))


def cuda_refusal(fmt: str) -> str:
    return (f"{fmt} experts (fp16 scales and zero points, as GPTQ and AWQ store them) run on CUDA only in the "
            f"one-launch layer kernel (--engine lean, in-features multiples of 32): torch's CUDA int4 kernel "
            f"reads bf16 scales, which would round them")


def write_dense(out: torch.Tensor, layout: ExpertLayout, name: str, w: torch.Tensor) -> None:
    dt = torch.bfloat16 if layout.fmt == "bf16" else torch.float32
    _part(out, layout, name).copy_(w.to(dt).contiguous().reshape(-1).view(torch.uint8))


def expert_bytes_of(layout: ExpertLayout, w13: torch.Tensor, w2: torch.Tensor, device_type: str,
                    out: torch.Tensor) -> None:
    """Write one expert (float w13 [2F, H], w2 [H, F]) into the byte buffer `out` in kernel form."""
    for name, w in (("w13", w13), ("w2", w2)):
        if layout.group:
            q = quantize_zp if layout.zero_point else quantize
            write_int4(out, layout, name, *q(w, layout.group), device_type)
        else:
            write_dense(out, layout, name, w)


class ExpertViews:
    """Typed views of one slot's bytes, built once per slot (no work on the hot path)."""
    __slots__ = ("layout", "w13", "w13_sz", "w2", "w2_sz")

    def __init__(self, layout: ExpertLayout, buf: torch.Tensor, device_type: str):
        self.layout = layout
        self.w13_sz = self.w2_sz = None
        for name in ("w13", "w2"):
            p = layout.part(name)
            raw = buf[p.offset: p.offset + p.nbytes]
            o, i = p.shape
            if layout.group:
                dt, shape = packed_shape(device_type, o, i)
                setattr(self, name, raw.view(dt).view(shape))
                q = layout.part(f"{name}_sz")
                setattr(self, f"{name}_sz", buf[q.offset: q.offset + q.nbytes].view(sz_dtype(layout))
                        .view(i // layout.group, o, 2))
            else:
                dt = torch.bfloat16 if layout.fmt == "bf16" else torch.float32
                setattr(self, name, raw.view(dt).view(o, i))


def ffn(x: torch.Tensor, v: ExpertViews, act=F.silu) -> torch.Tensor:
    """One expert on rows x [n, H]: act(x W1^T) * (x W3^T), then W2."""
    g = v.layout.group
    if g:
        gu = int4_mm(x, v.w13, g, v.w13_sz)
        a, b = gu.chunk(2, dim=-1)
        return int4_mm(act(a) * b, v.w2, g, v.w2_sz)
    a, b = F.linear(x, v.w13.to(x.dtype)).chunk(2, dim=-1)
    return F.linear(act(a) * b, v.w2.to(x.dtype))


BLOCK_K = 128          # k per block: 8 planes of 16


def pack_tiled(codes: torch.Tensor) -> torch.Tensor:
    """codes int32 [N, K] in 0..15 -> uint8 [N*K/2] in the tiled layout (any device)."""
    n, k = codes.shape
    if k % 32:
        raise CmoeError(f"tiled int4 needs in-features divisible by 32, got {k}")
    c = codes.to(torch.uint8)
    kb = k // BLOCK_K
    parts = []
    if kb:
        m = c[:, : kb * BLOCK_K].reshape(n, kb, 8, 16)                 # [n, block, plane, word]
        b = m[:, :, 0::2] | (m[:, :, 1::2] << 4)                       # [n, block, byte, word]
        parts.append(b.permute(1, 0, 3, 2).reshape(-1))                # [block, n, word, byte]
    pos = kb * BLOCK_K
    if (k - pos) >= 64:
        m = c[:, pos: pos + 64].reshape(n, 4, 16)
        b = m[:, 0::2] | (m[:, 1::2] << 4)                             # [n, 2 bytes, word]
        parts.append(b.permute(0, 2, 1).reshape(-1))                   # [n, word, byte]
        pos += 64
    if k - pos:
        m = c[:, pos: pos + 32].reshape(n, 2, 16)
        parts.append((m[:, 0] | (m[:, 1] << 4)).reshape(-1))           # [n, byte]
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
