"""A whole MoE layer's routed experts in one pass over their slot bytes: the tiled int4 layout the
Triton kernels read, the packing into it, and a plain-torch reference that computes the same
function from the same bytes (CPU or GPU). Torch only; Triton is imported lazily, on the first
call of `moe_forward` on a CUDA tensor (`cmoe.executor.kernels_triton`).

The layout (`tiled_layout`) keeps every part of `cmoe.executor.layout.expert_layout` at the same
offset with the same size (so the slot size, the simulator's byte count and the pool are
unchanged); only the order of the nibbles inside the two code parts differs. For a matrix
[N out, K in] (w13: [2F, H], gate rows first; w2: [H, F]):

| region | what | bytes |
| --- | --- | --- |
| main | int32 words [K//128, N, 16]: nibble p (bits 4p..4p+3) of word j of row n in k-block b holds the code of k = 128 b + 16 p + j | N * (K//128) * 64 |
| tail64 (K % 128 >= 64) | int16 words [N, 16]: nibble p (p < 4) of word j holds k = 128 (K//128) + 16 p + j | N * 32 |
| tail32 (K % 64 == 32) | uint8 [N, 16]: nibble p (p < 2) of byte j holds k = K - 32 + 16 p + j | N * 16 |

so one 16-byte load of a row's words feeds 4 contiguous k-columns of 8 "planes" of 16 k each:
a plane is a [rows, 16] operand of a tensor-core dot, unpacked in registers with a shift and a
mask. A k-block is one contiguous [N, 64 B] slab, so the rows a CTA reads are one contiguous
run. Scales and zeros stay as they are: bf16 [K/g, N, 2] (scale, zero) pairs, or fp16 (scale,
zero point) pairs in a `-fp16` format, read as one int32 each. The tail regions only exist for g = 32 or 64 with K not a multiple of 128 (toy shapes);
every real model's H and F are multiples of 128.

Codes follow `cmoe.executor.kernels`: w = (q - 8) * scale + zero, q in 0..15, groups of g input
features (`-fp16`: w = (q - zp) * scale, which the kernels compute as (q - 8) * s + (8 - zp) * s in fp32).

Calling convention (CUDA-graph safe on the GPU: no host sync, fixed shapes per batch size):

    out = moe_forward(x [M, H] bf16, topk_ids [M, k] int32, topk_weights [M, k] fp32/bf16,
                      slot_table int32 [E] (expert -> slot, -1 = not on the GPU: skipped),
                      pool uint8 [S, slot_bytes], layout)          # -> [M, H] x.dtype

out[m] = sum_j topk_weights[m, j] * W2 (silu(W1 x[m]) * (W3 x[m])) over the pairs whose expert
sits in a slot; ids outside [0, E) (e.g. -1 padding) are skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cmoe.core.errors import CmoeError
from cmoe.executor.kernels import BLOCK_K, dequantize, pack_tiled, sz_dtype  # noqa: F401 (re-exported)
from cmoe.executor.moe_route import route_into, route_reference  # noqa: F401 (re-exported)

__all__ = ["BLOCK_K", "dequantized", "moe_forward", "moe_reference", "pack_tiled", "read_expert", "route_into",
           "route_reference", "tiled_layout", "unpack_tiled", "write_codes"]
from cmoe.executor.layout import ExpertLayout, expert_layout



# --- layout ---------------------------------------------------------------------------------------

def tiled_layout(fmt: str, hidden: int, ffn: int) -> ExpertLayout:
    """The slot layout the Triton kernels read: the parts, offsets and sizes of `expert_layout`
    (so `nbytes` is equal by construction), the code parts packed by `pack_tiled`."""
    lay = expert_layout(fmt, hidden, ffn)
    if not lay.group:
        raise CmoeError(f"the tiled int4 layout is for w4g* formats, not '{fmt}'")
    return lay


def _regions(n: int, k: int) -> list[tuple[str, int, int]]:
    """(kind, byte offset, bytes) of the code regions of an [n, k] matrix."""
    kb, t = divmod(k, BLOCK_K)
    out, off = [("main", 0, n * kb * 64)], n * kb * 64
    if t >= 64:
        out.append(("tail64", off, n * 32))
        off += n * 32
    if t % 64:
        out.append(("tail32", off, n * 16))
        off += n * 16
    assert off == n * k // 2
    return out


def unpack_tiled(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 [N*K/2] tiled bytes -> codes int32 [N, K] (the inverse of `pack_tiled`)."""
    buf = buf.reshape(-1)
    out = torch.empty(n, k, dtype=torch.int32, device=buf.device)
    kb = k // BLOCK_K
    pos = 0
    for kind, off, nb in _regions(n, k):
        raw = buf[off: off + nb].to(torch.int32)
        if kind == "main":
            if kb == 0:
                continue
            b = raw.reshape(kb, n, 16, 4)                              # [block, n, word, byte]
            nib = torch.stack([b & 15, b >> 4], -1).reshape(kb, n, 16, 8)   # [.., word, plane]
            out[:, : kb * BLOCK_K] = nib.permute(1, 0, 3, 2).reshape(n, kb * BLOCK_K)
            pos = kb * BLOCK_K
        elif kind == "tail64":
            b = raw.reshape(n, 16, 2)
            nib = torch.stack([b & 15, b >> 4], -1).reshape(n, 16, 4)
            out[:, pos: pos + 64] = nib.permute(0, 2, 1).reshape(n, 64)
            pos += 64
        else:
            b = raw.reshape(n, 16)
            out[:, pos: pos + 32] = torch.stack([b & 15, b >> 4], 1).reshape(n, 32)
            pos += 32
    return out


def _part(buf: torch.Tensor, layout: ExpertLayout, name: str) -> torch.Tensor:
    p = layout.part(name)
    return buf[p.offset: p.offset + p.nbytes]


def write_codes(buf: torch.Tensor, layout: ExpertLayout, name: str, codes: torch.Tensor, sz: torch.Tensor) -> None:
    """Matrix `name` (w13 or w2) of one expert, as codes and scales, into its slot bytes."""
    _part(buf, layout, name).copy_(pack_tiled(codes).to(buf.device))
    _part(buf, layout, f"{name}_sz").copy_(sz.contiguous().reshape(-1).view(torch.uint8).to(buf.device))


def read_expert(buf: torch.Tensor, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """codes and scales of both matrices of one slot: {'w13': codes, 'w13_sz': sz, ...}."""
    out = {}
    for name in ("w13", "w2"):
        n, k = layout.part(name).shape
        out[name] = unpack_tiled(_part(buf, layout, name), n, k)
        out[f"{name}_sz"] = _part(buf, layout, f"{name}_sz").view(sz_dtype(layout)).view(k // layout.group, n, 2)
    return out


def dequantized(buf: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights (w13 [2F, H], w2 [H, F]) of one slot, by `cmoe.executor.kernels.dequantize`."""
    p = read_expert(buf, layout)
    g = layout.group
    return dequantize(p["w13"], p["w13_sz"], g), dequantize(p["w2"], p["w2_sz"], g)


# --- reference ------------------------------------------------------------------------------------

def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  slot_table: torch.Tensor, pool: torch.Tensor, layout: ExpertLayout,
                  act=F.silu, round_h: bool = True, out_dtype=None) -> torch.Tensor:
    """The layer in plain torch from the slot bytes (CPU or GPU, fp32 math, host-synchronous):
    the function the Triton kernels compute. round_h rounds the intermediate silu(g)*u to x's
    dtype, as the kernels do (their down projection reads it in bf16)."""
    M, H = x.shape
    E = slot_table.numel()
    xf = x.float()
    out = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.long().cpu()
    table = slot_table.long().cpu()
    wts = topk_weights.float()
    for e in sorted({int(v) for v in ids.reshape(-1).tolist() if 0 <= v < E}):
        s = int(table[e])
        if s < 0:
            continue
        rows, cols = (ids == e).nonzero(as_tuple=True)
        w13, w2 = dequantized(pool[s], layout)
        w13, w2 = w13.to(x.device), w2.to(x.device)
        r = rows.to(x.device)
        gu = xf.index_select(0, r) @ w13.T
        a, b = gu.chunk(2, dim=-1)
        h = act(a) * b
        if round_h:
            h = h.to(x.dtype).float()
        y = h @ w2.T
        out.index_add_(0, r, y * wts[r, cols.to(x.device)][:, None])
    return out.to(out_dtype or x.dtype)


# --- the fast path ---------------------------------------------------------------------------------

def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                slot_table: torch.Tensor, pool: torch.Tensor, layout: ExpertLayout,
                workspace=None, config=None, out_dtype=None) -> torch.Tensor:
    """The layer on the device: the Triton kernels on CUDA (with the CUDA C++ matmuls of
    `kernels_cuda` where the configuration names them), the reference elsewhere.
    `workspace` (kernels_triton.Workspace) holds the scratch buffers; pass the same one on every
    call of a CUDA graph. Returns [M, H] in out_dtype (default x.dtype)."""
    if not x.is_cuda:
        y = moe_reference(x, topk_ids, topk_weights, slot_table, pool, layout)
        return y if out_dtype is None else y.to(out_dtype)
    from cmoe.executor.kernels_triton import moe_triton
    return moe_triton(x, topk_ids, topk_weights, slot_table, pool, layout, workspace=workspace,
                      config=config, out_dtype=out_dtype)
