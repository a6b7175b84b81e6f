"""Small steps of a decoder layer in one launch each (CUDA; the lean engine's graphs).

`route_topk`: the softmax top-k routers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): after the
router's matmul, softmax in fp32, the top k, the optional renormalisation and the cast, in
one launch instead of transformers' five or six. Ties go to the lower expert id. exp and the
divisions are the accurate ones (libdevice expf, IEEE division), but the sum's order differs
from torch's, so a probability can differ in its last bit (the GPU tests bound it).

`route_mm_topk`: the same with the router's matmul in the launch, for a decode step's few rows:
programs over (row, hidden slice) store fp32 parts, and the last of a row's programs to finish (an
atomic counter) adds them in a fixed order, rounds the logits once to their dtype and takes the
top k of those rounded logits, so the result does not depend on which program ends last. At one
row torch's GEMM is cuBLAS's split-K with two reductions, three launches for 8 x 4096 (7.4 us a
layer on the H200, BENCHMARKS.md seventh session); here the router costs one launch with its top
k (3.9 us, 0.15 ms a token at batch 1; fourteenth session). A first version with one program a
row, reading the whole router, took 13.9 us a launch: one multiprocessor's bandwidth. The logits
may differ from cuBLAS's in the last bit where the two sum orders round differently (the lean
engine's q/k/v matmul has the same caveat).
CMOE_ROUTE_MM=0 keeps torch's matmul (the A/B of BENCHMARKS.md).

`residual_sum`: X_m's end, out = mid + (shared + y) with y the experts' fp32 sum rounded to the
activations' dtype, each sum rounded as torch's element-wise adds round (bit-equal to the three
launches it replaces: the cast, the add, the copy into the segment's output).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cmoe.executor.kernels_triton import scratch

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _exp(x):
    if _INTERPRET:                      # the interpreter has no libdevice
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _div(a, b):
    if _INTERPRET:
        return a / b
    return tl.math.div_rn(a, b)


@triton.jit
def _topk_store(x, r, e, m, w_ptr, idx_ptr, E, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                RENORM: tl.constexpr):
    """Row r's softmax over the fp32 logits x (-inf where not m), its top K and their weights."""
    p = _exp(x - tl.max(x, 0))
    p = tl.where(m, p, 0.0)
    p = _div(p, tl.broadcast_to(tl.sum(p, 0), [EP]))
    work = tl.where(m & (p == p), p, -1.0)              # NaN (an overflowed row) ranks last
    kk = tl.arange(0, KP)
    vals = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int64)
    for j in tl.static_range(K):
        v = tl.max(work, 0)
        i = tl.minimum(tl.min(tl.where(work == v, e, EP), 0), E - 1)     # always a real expert id
        vals = tl.where(kk == j, v, vals)
        ids = tl.where(kk == j, i.to(tl.int64), ids)
        work = tl.where(e == i, -1.0, work)
    if RENORM:
        vals = _div(vals, tl.broadcast_to(tl.sum(tl.where(kk < K, vals, 0.0), 0), [KP]))
    km = kk < K
    tl.store(w_ptr + r * K + kk, vals.to(w_ptr.dtype.element_ty), mask=km)
    tl.store(idx_ptr + r * K + kk, ids, mask=km)


@triton.jit
def _route_topk(logits_ptr, stride, w_ptr, idx_ptr, E, K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                RENORM: tl.constexpr):
    r = tl.program_id(0)
    e = tl.arange(0, EP)
    m = e < E
    x = tl.load(logits_ptr + r * stride + e, mask=m, other=float("-inf")).to(tl.float32)
    _topk_store(x, r, e, m, w_ptr, idx_ptr, E, K, EP, KP, RENORM)


@triton.jit
def _route_mm_topk(x_ptr, stride, rw_ptr, part_ptr, cnt_ptr, lg_ptr, w_ptr, idx_ptr, E, Hd, S,
                   K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, HB: tl.constexpr, RENORM: tl.constexpr):
    """Program (r, sp): row r's fp32 dots over hidden slice sp (HB wide) into part [r, sp]; the
    last of the row's S programs to finish (a counter, reset by it for the next launch) adds the S
    parts in order s = 0..S-1, rounds the logits once to their dtype (as a GEMM with fp32
    accumulation rounds), stores them, and runs `_topk_store` on the rounded logits."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    e = tl.arange(0, EP)
    m = e < E
    hh = sp * HB + tl.arange(0, HB)
    mh = hh < Hd
    xv = tl.load(x_ptr + r * stride + hh, mask=mh, other=0.0).to(tl.float32)
    wv = tl.load(rw_ptr + e[:, None] * Hd + hh[None, :], mask=m[:, None] & mh[None, :], other=0.0)
    tl.store(part_ptr + (r * S + sp) * EP + e, tl.sum(wv.to(tl.float32) * xv[None, :], 1))
    tl.debug_barrier()                                # every thread's part is stored before the count
    if tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel", scope="gpu") == S - 1:
        acc = tl.zeros([EP], tl.float32)
        for s in range(S):
            acc += tl.load(part_ptr + (r * S + s) * EP + e, cache_modifier=".cg")
        tl.store(cnt_ptr + r, 0)
        lg = acc.to(lg_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(lg_ptr + r * E + e, lg, mask=m)
        x = tl.where(m, lg.to(tl.float32), float("-inf"))
        _topk_store(x, r, e, m, w_ptr, idx_ptr, E, K, EP, KP, RENORM)


def route_topk(logits: torch.Tensor, k: int, renorm: bool, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] in out_dtype, expert ids [N, k] int64), as the routers do."""
    N, E = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    w = torch.empty((N, k), dtype=out_dtype, device=logits.device)
    idx = torch.empty((N, k), dtype=torch.int64, device=logits.device)
    EP = triton.next_power_of_2(E)
    _route_topk[(N,)](logits, logits.stride(0), w, idx, E, K=k, EP=EP, KP=triton.next_power_of_2(k),
                      RENORM=renorm, num_warps=1 if EP <= 128 else 4)
    return w, idx


# rows up to which the routers' matmul is `_route_mm_topk`: decode batches; longer passes (prefill)
# keep torch's GEMM
ROUTE_MM_MAX_ROWS = 16


def route_mm_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renorm: bool, out_dtype):
    """x [N, H] @ weight [E, H]^T -> (logits [N, E] in x's dtype, weights [N, k], ids [N, k]) in one
    launch: F.linear then `route_topk`, for a few rows, the hidden size split over programs of
    ~2048 weights each. The logits are the fp32 dot rounded once, so they may differ from cuBLAS's
    in the last bit where its sum order rounds the other way."""
    N, Hd = x.shape
    E = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    EP = triton.next_power_of_2(E)
    HB = min(triton.next_power_of_2(Hd), max(16, 2048 // EP))
    S = triton.cdiv(Hd, HB)
    part, cnt = scratch.counted("route_mm_topk", x.device, (N * S * EP,), N)
    lg = torch.empty((N, E), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    w = torch.empty((N, k), dtype=out_dtype, device=x.device)
    idx = torch.empty((N, k), dtype=torch.int64, device=x.device)
    _route_mm_topk[(N, S)](x, x.stride(0), weight, part, cnt, lg, w, idx, E, Hd, S, K=k, EP=EP,
                           KP=triton.next_power_of_2(k), HB=HB, RENORM=renorm, num_warps=4)
    return lg, w, idx


# router class -> (renormalise: attribute name or True, scores in the logits' dtype)
ROUTERS = {"MixtralTopKRouter": (True, False), "Qwen2MoeTopKRouter": ("norm_topk_prob", True),
           "Qwen3MoeTopKRouter": ("norm_topk_prob", True), "OlmoeTopKRouter": ("norm_topk_prob", True)}


def fuse_routers(model, mm: bool | None = None) -> list:
    """Point every softmax top-k router of `model` at `route_topk`, and for up to ROUTE_MM_MAX_ROWS
    rows (decode) at `route_mm_topk`, its matmul too (mm; default: CMOE_ROUTE_MM, on unless "0").
    Returns what `unfuse` in norm.py needs to put them back."""
    import torch.nn.functional as F
    if mm is None:
        mm = os.environ.get("CMOE_ROUTE_MM", "1") != "0"
    done = []
    for mod in model.modules():
        how = ROUTERS.get(type(mod).__name__)
        if how is None or getattr(mod, "training", False):
            continue
        renorm = how[0] if how[0] is True else bool(getattr(mod, how[0]))

        def fwd(hidden_states, _m=mod, _renorm=renorm, _cast=how[1]):
            h = hidden_states.reshape(-1, _m.hidden_dim)
            if mm and h.shape[0] <= ROUTE_MM_MAX_ROWS and h.dtype == _m.weight.dtype:
                return route_mm_topk(h, _m.weight, _m.top_k, _renorm, h.dtype if _cast else torch.float32)
            logits = F.linear(h, _m.weight)
            w, idx = route_topk(logits, _m.top_k, _renorm, logits.dtype if _cast else torch.float32)
            return logits, w, idx
        mod.forward = fwd
        done.append(mod)
    return done


@triton.jit
def _residual_sum(mid_ptr, acc_ptr, sh_ptr, out_ptr, n, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    dt = out_ptr.dtype.element_ty
    y = tl.load(acc_ptr + offs, mask=keep, other=0.0).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    if HAS_SHARED:
        s = tl.load(sh_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        y = (s + y).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    mid = tl.load(mid_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (mid + y).to(dt, fp_downcast_rounding="rtne"), mask=keep)


def residual_sum(mid: torch.Tensor, acc: torch.Tensor, shared: torch.Tensor | None, out: torch.Tensor | None):
    """mid + (shared + y), y = acc (fp32) in mid's dtype; written into `out` when given."""
    if out is None:
        out = torch.empty_like(mid)
    n = mid.numel()
    for t in (mid, acc, out) + ((shared,) if shared is not None else ()):
        if not t.is_contiguous() or t.numel() != n:
            raise ValueError("residual_sum takes contiguous tensors of one size")
    BLOCK = 1024
    _residual_sum[(triton.cdiv(n, BLOCK),)](mid, acc, shared if shared is not None else mid, out, n,
                                            HAS_SHARED=shared is not None, BLOCK=BLOCK, num_warps=4)
    return out
