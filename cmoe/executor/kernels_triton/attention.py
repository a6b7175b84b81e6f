"""One decode step's attention in two launches (the CUDA side of `cmoe.executor.attention`).

`_rope_write`, grid (B, Hq + Hkv): a program rotates one head of one row, q into a fresh buffer,
k into the static cache at the decode slot (read on the device, so a graph replays it), and
copies v beside it. The rotation rounds each product and the sum to the activations' dtype, as
transformers' element-wise `q * cos + rotate_half(q) * sin` does, and is compiled without
fused multiply-adds (which would skip the products' rounding in fp32), so the results are equal.

`_attend`, grid (B, Hkv): a program takes the G = Hq / Hkv query heads that share one kv head
(GQA without repeating the cache) and walks the cache in blocks of BL slots with an online
softmax in fp32 (scores from a tensor-core dot, rows padded to 16), skipping slots whose `valid`
entry is False. Every row has at least its own slot valid, so no softmax row is empty.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_NEG = tl.constexpr(-1.0e30)   # finite: a block with every slot masked must not make exp(-inf + inf)


@triton.jit
def _rot(base, d, pd, keep, c, s, sign):
    x = tl.load(base + d, mask=keep, other=0.0)
    p = tl.load(base + pd, mask=keep, other=0.0)
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    b = (p.to(tl.float32) * sign * s).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    return (a + b).to(dt, fp_downcast_rounding="rtne")


@triton.jit
def _rope_write(q_ptr, sqb, sqh, k_ptr, skb, skh, v_ptr, svb, svh, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr,
                slot_ptr, HQ, HKV, L, D: tl.constexpr, DP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    keep = d < D
    half = D // 2
    pd = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    c = tl.load(cos_ptr + b * D + d, mask=keep, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * D + d, mask=keep, other=0.0).to(tl.float32)
    if h < HQ:
        y = _rot(q_ptr + b * sqb + h * sqh, d, pd, keep, c, s, sign)
        tl.store(qo_ptr + (b * HQ + h) * D + d, y, mask=keep)
    else:
        j = h - HQ
        slot = tl.load(slot_ptr)
        off = ((b * HKV + j).to(tl.int64) * L + slot) * D + d
        y = _rot(k_ptr + b * skb + j * skh, d, pd, keep, c, s, sign)
        tl.store(kc_ptr + off, y, mask=keep)
        v = tl.load(v_ptr + b * svb + j * svh + d, mask=keep, other=0.0)
        tl.store(vc_ptr + off, v, mask=keep)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend(q_ptr, kc_ptr, vc_ptr, valid_ptr, slot_ptr, o_ptr, HQ, HKV, L, scale, G: tl.constexpr,
            GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    dm = d < D
    rows = (b * HQ + j * G + g).to(tl.int64)
    qm = (g < G)[:, None] & dm[None, :]
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=qm, other=0.0)
    m_i = tl.full([GP], _NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    base = (b * HKV + j).to(tl.int64) * L * D
    # keys up to the slot written this step, never the cache's whole length: nothing past it is
    # valid yet, and walking it cost the H200 ~1.6 us per 64 empty keys per layer
    n_keys = tl.minimum(tl.load(slot_ptr).to(tl.int32) + 1, L)
    for start in range(0, n_keys, BL):
        n = start + tl.arange(0, BL)
        nm = n < n_keys
        ok = tl.load(valid_ptr + b * L + n, mask=nm, other=0) != 0
        kt = tl.load(kc_ptr + base + n[None, :] * D + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
        sc = _dot(q, kt, IEEE) * scale
        sc = tl.where(ok[None, :], sc, _NEG)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(vc_ptr + base + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qm)


def decode_attention(q, k, v, cos, sin, keys, values, slot, valid, scaling):
    """q [B, Hq, D], k and v [B, Hkv, D] (any row and head strides, unit element stride), cos and
    sin [B, D], keys/values [B, Hkv, L, D] contiguous, slot a one-element long tensor, valid
    [B, L] bool, False past the slot (`cmoe.executor.kv.StaticKV` keeps it so: keys past the slot
    are not read). Writes the slot; returns the attention output [B, Hq * D]."""
    B, Hq, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k and v need a unit stride along the head dim")
    if not (keys.is_contiguous() and values.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("the cache and the rotary tables must be contiguous")
    DP = triton.next_power_of_2(D)
    qo = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    _rope_write[(B, Hq + Hkv)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0),
                               v.stride(1), cos, sin, qo, keys, values, slot, Hq, Hkv, L, D=D, DP=DP,
                               num_warps=1 if DP <= 128 else 2, enable_fp_fusion=False)
    G = Hq // Hkv
    o = torch.empty((B, Hq * D), dtype=q.dtype, device=q.device)
    _attend[(B, Hkv)](qo, keys, values, valid.view(torch.uint8), slot, o, Hq, Hkv, L, float(scaling), G=G,
                      GP=max(16, triton.next_power_of_2(G)), D=D, DP=max(16, DP), BL=64,
                      IEEE=q.dtype == torch.float32, num_warps=4)
    return o
