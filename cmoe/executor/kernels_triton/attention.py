"""One decode step's attention in one launch (the CUDA side of `cmoe.executor.attention`).

`_rope_attend`, grid (B, Hkv, S): a program takes one kv head of one row, the G = Hq / Hkv query
heads that share it (GQA without repeating the cache), and one run of CH keys of the cache. The
program whose run holds the decode slot (read on the device, so a graph replays it) rotates the
new key into the static cache there and copies the value beside it; every program rotates its
query heads in registers, then (after a barrier: the slot written is read back) walks its keys in
blocks of BL slots with an online softmax in fp32 (scores from a tensor-core dot, rows padded to
16), skipping slots whose `valid` entry is False. With S > 1 each program stores its softmax state
and the last of a head's S programs to finish merges them in a fixed order (`_combine`), so the
result does not depend on which finished first. Every row has at least its own slot valid, so no
softmax row is empty.

Why the split (`splits`: runs of a multiple of 64 keys, at most 16 a head; CMOE_ATTN_SPLIT=0 keeps
one program a head): at batch 1 a head's program walked every key alone, one dependent block
after another, on 8 of the H200's 132 multiprocessors; the merge costs one more pass over S small
states. Measured on the H200 (BENCHMARKS.md, fifteenth session): 11.6 against 54.0 us a launch at
2049 keys and batch 1, but 9.6 against 5.5 at 65 keys of a 2112-slot cache, where the runs, sized
by the cache, are mostly empty and the merge still waits for them. CMOE_ATTN_SPLIT=keys sizes them
by the keys so far instead: 6.2 us there, but 7.8 against 6.7 at 320 keys of 320 and `upper` the
same (sixteenth session), so it stays opt-in. The rotation rounds each product and the sum to the
activations' dtype, as transformers' element-wise `q * cos + rotate_half(q) * sin` does, and the
kernel is compiled without fused multiply-adds (which would skip the products' rounding in fp32),
so the rotated q and k equal transformers'.

Why one launch: under the lean engine's graphs each node costs the GPU ~2-3 us however small, and
a decode layer's attention was two (`_rope_write`, grid (B, Hq + Hkv), a head a program, then the
attention). CMOE_ROPE_ATTEND=0 runs those two launches again (the A/B of BENCHMARKS.md; the
attention then keeps fused multiply-adds, as it was).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cmoe.core.hw import split_plan
from cmoe.executor.kernels_triton import scratch
from cmoe.executor.kernels_triton.gemv import pdl_enabled

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_NEG = tl.constexpr(-1.0e30)   # finite: a block with every slot masked must not make exp(-inf + inf)


@triton.jit
def _rot(x, p, c, s, sign):
    """x * cos + rotate_half(x) * sin (p: x's partner halves), each product and the sum rounded
    to x's dtype as transformers' element-wise ops round them."""
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    b = (p.to(tl.float32) * sign * s).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    return (a + b).to(dt, fp_downcast_rounding="rtne")


@triton.jit
def _tables(cos_ptr, sin_ptr, b, d, keep, D: tl.constexpr):
    """Row b's rotation: each lane's partner in the other half, the sign of rotate_half, cos, sin."""
    half = D // 2
    pd = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    c = tl.load(cos_ptr + b * D + d, mask=keep, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * D + d, mask=keep, other=0.0).to(tl.float32)
    return pd, sign, c, s


@triton.jit
def _write_kv(k_ptr, skb, skh, v_ptr, svb, svh, kc_ptr, vc_ptr, b, j, slot, HKV, L, D: tl.constexpr, d, pd, keep,
              c, s, sign):
    """kv head j of row b into the cache at the slot: its key rotated, its value as it is."""
    off = ((b * HKV + j).to(tl.int64) * L + slot) * D + d
    kb = k_ptr + b * skb + j * skh
    tl.store(kc_ptr + off, _rot(tl.load(kb + d, mask=keep, other=0.0), tl.load(kb + pd, mask=keep, other=0.0),
                                c, s, sign), mask=keep)
    tl.store(vc_ptr + off, tl.load(v_ptr + b * svb + j * svh + d, mask=keep, other=0.0), mask=keep)


@triton.jit
def _rope_write(q_ptr, sqb, sqh, k_ptr, skb, skh, v_ptr, svb, svh, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr,
                slot_ptr, HQ, HKV, L, D: tl.constexpr, DP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    keep = d < D
    pd, sign, c, s = _tables(cos_ptr, sin_ptr, b, d, keep, D)
    if h < HQ:
        qb = q_ptr + b * sqb + h * sqh
        y = _rot(tl.load(qb + d, mask=keep, other=0.0), tl.load(qb + pd, mask=keep, other=0.0), c, s, sign)
        tl.store(qo_ptr + (b * HQ + h) * D + d, y, mask=keep)
    else:
        _write_kv(k_ptr, skb, skh, v_ptr, svb, svh, kc_ptr, vc_ptr, b, h - HQ, tl.load(slot_ptr), HKV, L, D, d, pd,
                  keep, c, s, sign)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rope_attend(q_ptr, sqb, sqh, k_ptr, skb, skh, v_ptr, svb, svh, cos_ptr, sin_ptr, kc_ptr, vc_ptr, valid_ptr,
                 slot_ptr, o_ptr, pm_ptr, pacc_ptr, cnt_ptr, HQ, HKV, L, CH, S, scale, G: tl.constexpr,
                 GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr, IEEE: tl.constexpr,
                 ROPE: tl.constexpr, SPLIT: tl.constexpr, BY_KEYS: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:                 # the o projection's GEMV may start now and wait (`gemv.pdl_enabled`)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    j = tl.program_id(1)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr)
    # keys up to the slot written this step, never the cache's whole length: nothing past it is
    # valid yet, and walking it cost the H200 ~1.6 us per 64 empty keys per layer
    n_keys = tl.minimum(slot.to(tl.int32) + 1, L)
    if BY_KEYS:                 # runs sized by the keys so far: at least 2 blocks, at most S of them
        ch = tl.maximum(2 * BL, BL * tl.cdiv(tl.cdiv(n_keys, S), BL))
        runs = tl.cdiv(n_keys, ch)
    else:                       # runs sized by the cache: S of CH keys, the empty ones included
        ch = CH
        runs = S
    if sp < runs:
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        dm = d < D
        lo = sp * ch                                   # this program's keys: [lo, hi)
        hi = tl.minimum(lo + ch, n_keys)
        qm = (g < G)[:, None] & dm[None, :]
        q = _query(q_ptr + b * sqb + (j * G + g)[:, None] * sqh, qm, k_ptr, skb, skh, v_ptr, svb, svh, cos_ptr,
                   sin_ptr, kc_ptr, vc_ptr, b, j, slot, (slot >= lo) & (slot < lo + ch), HKV, L, d, dm, D, ROPE)
        head = (b * HKV + j).to(tl.int64) * L * D     # this head's cache
        m_i, l_i, acc = _walk(q, kc_ptr + head, vc_ptr + head, valid_ptr + b * L, lo, hi, scale, d, dm, GP, D, DP,
                              BL, IEEE)
        rows = (b * HQ + j * G + g).to(tl.int64)
        if SPLIT:
            if runs == 1:
                tl.store(o_ptr + rows[:, None] * D + d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
                         mask=qm)
            else:
                _combine(m_i, l_i, acc, pm_ptr, pacc_ptr, cnt_ptr, o_ptr, rows, b * HKV + j, sp, runs, S, g, d, qm,
                         GP, D, DP)
        else:
            tl.store(o_ptr + rows[:, None] * D + d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _query(qb, qm, k_ptr, skb, skh, v_ptr, svb, svh, cos_ptr, sin_ptr, kc_ptr, vc_ptr, b, j, slot, writes, HKV, L,
           d, dm, D: tl.constexpr, ROPE: tl.constexpr):
    """The G query heads at qb, rotated (ROPE; else as `_rope_write` left them); the program that
    `writes` also puts the head's new key (rotated) and value into the cache at the slot first."""
    if ROPE:
        pd, sign, c, s = _tables(cos_ptr, sin_ptr, b, d, dm, D)
        if writes:
            _write_kv(k_ptr, skb, skh, v_ptr, svb, svh, kc_ptr, vc_ptr, b, j, slot, HKV, L, D, d, pd, dm, c, s, sign)
        q = _rot(tl.load(qb + d[None, :], mask=qm, other=0.0), tl.load(qb + pd[None, :], mask=qm, other=0.0),
                 c[None, :], s[None, :], sign[None, :])
        tl.debug_barrier()              # the slot's key and value, stored above, are read after
    else:
        q = tl.load(qb + d[None, :], mask=qm, other=0.0)
    return q


@triton.jit
def _walk(q, kb, vb, ok_ptr, lo, hi, scale, d, dm, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
          BL: tl.constexpr, IEEE: tl.constexpr):
    """Keys [lo, hi) of one head's cache (kb, vb) in blocks of BL with an online softmax in fp32:
    (running max, sum, unnormalised output) over the slots whose `valid` entry (ok_ptr) is set."""
    m_i = tl.full([GP], _NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(lo, hi, BL):
        n = start + tl.arange(0, BL)
        nm = n < hi
        ok = tl.load(ok_ptr + n, mask=nm, other=0) != 0
        kt = tl.load(kb + n[None, :] * D + d[:, None], mask=nm[None, :] & dm[:, None], other=0.0)
        sc = _dot(q, kt, IEEE) * scale
        sc = tl.where(ok[None, :], sc, _NEG)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(vb + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _combine(m_i, l_i, acc, pm_ptr, pacc_ptr, cnt_ptr, o_ptr, rows, bj, sp, runs, S, g, d, qm, GP: tl.constexpr,
             D: tl.constexpr, DP: tl.constexpr):
    """Run sp of head bj stores its softmax state (running max, sum, unnormalised output); the
    last of the head's `runs` programs to finish (a counter, reset by it for the next launch)
    merges the states in order s = 0..runs-1 and stores the output. A run with no keys left holds
    the max _NEG and a zero sum, and one whose keys are all invalid the max _NEG and a sum of
    their exp(0) terms; either way its weight in the merge is exp(_NEG - max) = 0, since the run
    that holds the slot (always valid) has a real max."""
    at = (bj * S + sp).to(tl.int64)
    tl.store(pm_ptr + (at * 2) * GP + g, m_i)
    tl.store(pm_ptr + (at * 2 + 1) * GP + g, l_i)
    tl.store(pacc_ptr + (at * GP + g[:, None]) * DP + d[None, :], acc)
    tl.debug_barrier()                                # every thread's state is stored before the count
    if tl.atomic_add(cnt_ptr + bj, 1, sem="acq_rel", scope="gpu") == runs - 1:
        m = tl.full([GP], _NEG, tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        o = tl.zeros([GP, DP], tl.float32)
        for s in range(runs):
            at = (bj * S + s).to(tl.int64)
            ms = tl.load(pm_ptr + (at * 2) * GP + g, cache_modifier=".cg")
            ls = tl.load(pm_ptr + (at * 2 + 1) * GP + g, cache_modifier=".cg")
            accs = tl.load(pacc_ptr + (at * GP + g[:, None]) * DP + d[None, :], cache_modifier=".cg")
            mn = tl.maximum(m, ms)
            a, c = tl.exp(m - mn), tl.exp(ms - mn)
            lsum = lsum * a + ls * c
            o = o * a[:, None] + accs * c[:, None]
            m = mn
        tl.store(cnt_ptr + bj, 0)
        o = o / lsum[:, None]
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
    one = os.environ.get("CMOE_ROPE_ATTEND", "1") != "0"
    if not one:                          # the two-launch A/B: q rotated into its own buffer first
        qo = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
        _rope_write[(B, Hq + Hkv)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0),
                                   v.stride(1), cos, sin, qo, keys, values, slot, Hq, Hkv, L, D=D, DP=DP,
                                   num_warps=1 if DP <= 128 else 2, enable_fp_fusion=False)
        q = qo
    G = Hq // Hkv
    GP, DPP = max(16, triton.next_power_of_2(G)), max(16, DP)
    o = torch.empty((B, Hq * D), dtype=q.dtype, device=q.device)
    mode = split_mode()
    S, CH = splits(L, mode)
    by_keys = S > 1 and mode == "keys"
    pm = pacc = cnt = o                  # unused without splits
    if S > 1:
        # the runs' softmax states: max and sum [B * Hkv, S, 2, GP], outputs [B * Hkv, S, GP, DPP]
        pm, pacc, cnt = scratch.counted("decode_attention", q.device, (B * Hkv * S * 2 * GP, B * Hkv * S * GP * DPP),
                                        B * Hkv)
    _rope_attend[(B, Hkv, S)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
                              cos, sin, keys, values, valid.view(torch.uint8), slot, o, pm, pacc, cnt, Hq, Hkv, L,
                              CH, S, float(scaling), G=G, GP=GP, D=D, DP=DPP, BL=BL, IEEE=q.dtype == torch.float32,
                              ROPE=one, SPLIT=S > 1, BY_KEYS=by_keys, TRIGGER=pdl_enabled(q.device), num_warps=4,
                              enable_fp_fusion=not one)
    return o


BL = 64                                  # keys a program takes per step
MAX_SPLITS = 16


def split_mode() -> str:
    """CMOE_ATTN_SPLIT: "1" (the default, runs sized by the cache), "0" (one program a head) or
    "keys" (runs sized by the keys so far)."""
    return os.environ.get("CMOE_ATTN_SPLIT", "1")


def splits(L: int, mode: str | None = None) -> tuple[int, int]:
    """(S, CH): the cache's L keys cut into S runs of CH keys (a multiple of BL), one program each
    per kv head, at most MAX_SPLITS; (1, L) in mode "0" (`split_mode`, read here when not given) or
    when one run of BL covers L. Mode "keys" (opt-in: measured on the H200, sixteenth session, no
    faster in `upper`) keeps the S programs but sizes the runs on the device by the keys so far: at
    least 2 blocks of BL each, so that a head with up to 2 * BL keys runs one program and merges
    nothing, and the programs past the last run return at once."""
    mode = split_mode() if mode is None else mode
    return split_plan(L, 1 if mode == "0" else MAX_SPLITS, BL)      # the rule the simulator prices too
