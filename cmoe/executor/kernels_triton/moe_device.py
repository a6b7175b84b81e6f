"""The MoE layer's Triton kernels (launched from `moe.py`, which describes the scheme): `_expert_mm`
(gate/up with SiLU, or down with the routing weights) with its parts as @triton.jit helpers
(inlined: `_units` the whole k-units of a split, `_block` one 128-k block of a unit, `_tail` with
`_tail64` / `_tail32` the k tail, `_store` the epilogue), `_gate_up_kernel` (the split-K w13's
reduction) and `_route_kernel`. The unpacking and dequantizing helpers are in `moe_dequant.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cmoe.executor.kernels_triton.moe_dequant import _deq4, _flush, _ldsz, _pick4, _planes4, _step


@triton.jit
def _block(acc_g, acc_u, a_g, a_u, xs, blk, kb, N, wrow, wmask, xrow, rk, mrow, ones, zero,
           cg0, cg1, cg2, cg3, cu0, cu1, cu2, cu3, b: tl.constexpr, PPG: tl.constexpr,
           IS_W13: tl.constexpr, ASM: tl.constexpr, DEQ: tl.constexpr, ZP: tl.constexpr):
    """Block b (128 k, 8 planes of int32 words at blk) of a k-unit whose (scale, zero) pairs are
    cg0..cg3 (gate) and cu0..cu3 (up): the accumulators after it."""
    wg = tl.load(blk + wrow, mask=wmask, other=0)
    if IS_W13:
        wu = tl.load(blk + N * 16 + wrow, mask=wmask, other=0)
    k0 = kb * 128
    for hi in tl.static_range(2):
        if DEQ:
            qa = (b * 8 + hi * 4) // PPG
            qb = (b * 8 + hi * 4 + 2) // PPG
            pg = _deq4(wg, _pick4(qa, cg0, cg1, cg2, cg3), _pick4(qb, cg0, cg1, cg2, cg3), hi, ASM, ZP)
            if IS_W13:
                pu = _deq4(wu, _pick4(qa, cu0, cu1, cu2, cu3), _pick4(qb, cu0, cu1, cu2, cu3), hi, ASM, ZP)
        else:
            pg = _planes4(wg, hi, ASM)
            if IS_W13:
                pu = _planes4(wu, hi, ASM)
        for p4 in tl.static_range(4):
            p = hi * 4 + p4
            xt = tl.load(xrow + (k0 + p * 16 + rk)[:, None], mask=mrow[None, :], other=0.0)
            if IS_W13:
                acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p4], pu[p4], xt, ones,
                                                   IS_W13, DEQ)
            else:
                acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p4], pg[p4], xt, ones,
                                                   IS_W13, DEQ)
            if not DEQ:
                if (b * 8 + p + 1) % PPG == 0:
                    q = (b * 8 + p) // PPG
                    acc_g = _flush(acc_g, a_g, xs, _pick4(q, cg0, cg1, cg2, cg3), ZP)
                    if IS_W13:
                        acc_u = _flush(acc_u, a_u, xs, _pick4(q, cu0, cu1, cu2, cu3), ZP)
                    a_g = zero
                    a_u = zero
                    xs = zero
    return acc_g, acc_u, a_g, a_u, xs


@triton.jit
def _unit(acc_g, acc_u, a_g, a_u, xs, sg0, sg1, sg2, sg3, su0, su1, su2, su3, u, u_hi, wp, sp, NR, N, rn, mn,
          wrow, wmask, xrow, rk, mrow, ones, zero, BPU: tl.constexpr, PPG: tl.constexpr, GPU: tl.constexpr,
          IS_W13: tl.constexpr, ASM: tl.constexpr, DEQ: tl.constexpr, ZP: tl.constexpr):
    """k-unit u, whose (scale, zero) pairs were loaded one unit ahead: the accumulators after it and
    the next unit's pairs."""
    cg0, cg1, cg2, cg3, cu0, cu1, cu2, cu3 = sg0, sg1, sg2, sg3, su0, su1, su2, su3
    sg0, sg1, sg2, sg3, su0, su1, su2, su3 = _ldsz(sp, (u + 1) * GPU, NR, N, rn, mn & (u + 1 < u_hi), GPU, IS_W13)
    for b in tl.static_range(BPU):
        kb = u * BPU + b
        blk = wp + kb * NR * 16
        acc_g, acc_u, a_g, a_u, xs = _block(acc_g, acc_u, a_g, a_u, xs, blk, kb, N, wrow, wmask, xrow, rk,
                                            mrow, ones, zero, cg0, cg1, cg2, cg3, cu0, cu1, cu2, cu3,
                                            b, PPG, IS_W13, ASM, DEQ, ZP)
    return acc_g, acc_u, a_g, a_u, xs, sg0, sg1, sg2, sg3, su0, su1, su2, su3


@triton.jit
def _units(wp, sp, NR, N, K, pid_k, UPS, rn, mn, wrow, wmask, xrow, rk, mrow, ones, zero,
           U: tl.constexpr, BPU: tl.constexpr, PPG: tl.constexpr, GPU: tl.constexpr,
           IS_W13: tl.constexpr, ASM: tl.constexpr, DEQ: tl.constexpr, ZP: tl.constexpr, UNR: tl.constexpr,
           STG: tl.constexpr):
    """The whole k-units of split pid_k (UPS units a split): the accumulators (acc_g, acc_u, and
    without DEQ the open group's a_g, a_u, xs) after them, from zero. UNR > 1 unrolls the unit loop
    that many times, so that the weight loads of UNR units are issued before the first is used.
    STG (None: the launch's num_stages) sets the loop's own stages. The loop has dots, so Triton
    already pipelines its loads at the launch's stages (36-48 cp.async in its sm_90 code); naming
    them measured no faster on the H200 (29.7 against 29.6 us, BENCHMARKS.md, seventh session), so
    CONFIGS leave it unset. (A loop without dots is pipelined only when it names its stages.)"""
    acc_g = zero
    acc_u = zero
    a_g = zero
    a_u = zero
    xs = zero
    n_units = K // U
    u_lo = pid_k * UPS
    u_hi = tl.minimum(n_units, u_lo + UPS)
    # the scales of the next unit are loaded one unit ahead (their latency hides behind a unit)
    sg0, sg1, sg2, sg3, su0, su1, su2, su3 = _ldsz(sp, u_lo * GPU, NR, N, rn, mn & (u_lo < u_hi), GPU, IS_W13)
    for u in tl.range(u_lo, u_hi, num_stages=STG, loop_unroll_factor=UNR):
        acc_g, acc_u, a_g, a_u, xs, sg0, sg1, sg2, sg3, su0, su1, su2, su3 = _unit(
            acc_g, acc_u, a_g, a_u, xs, sg0, sg1, sg2, sg3, su0, su1, su2, su3, u, u_hi, wp, sp, NR, N, rn, mn,
            wrow, wmask, xrow, rk, mrow, ones, zero, BPU, PPG, GPU, IS_W13, ASM, DEQ, ZP)
    return acc_g, acc_u, a_g, a_u, xs


@triton.jit
def _tail64(acc_g, acc_u, a_g, a_u, xs, tb, k0, sp, NR, N, rn, mn, wrow, wmask, xrow, rk, mrow, ones, zero,
            G: tl.constexpr, PPG: tl.constexpr, IS_W13: tl.constexpr, DEQ: tl.constexpr, ZP: tl.constexpr):
    """The k tail's 64 k (4 planes in int16 words at tb, from k0): the accumulators after them."""
    tp = tb.to(tl.pointer_type(tl.int16))
    ga, gb, _g2, _g3, ua, ub, _u2, _u3 = _ldsz(sp, k0 // G, NR, N, rn, mn, 2 if G == 32 else 1, IS_W13)
    wg = tl.load(tp + wrow, mask=wmask, other=0).to(tl.int32)
    if DEQ:
        pg = _deq4(wg, ga, gb, 0, False, ZP)
    else:
        pg = _planes4(wg, 0, False)
    if IS_W13:
        wu = tl.load(tp + N * 16 + wrow, mask=wmask, other=0).to(tl.int32)
        if DEQ:
            pu = _deq4(wu, ua, ub, 0, False, ZP)
        else:
            pu = _planes4(wu, 0, False)
    for p in tl.static_range(4):
        xt = tl.load(xrow + (k0 + p * 16 + rk)[:, None], mask=mrow[None, :], other=0.0)
        if IS_W13:
            acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p], pu[p], xt, ones,
                                               IS_W13, DEQ)
        else:
            acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p], pg[p], xt, ones,
                                               IS_W13, DEQ)
        if not DEQ:
            if (p + 1) % PPG == 0:
                acc_g = _flush(acc_g, a_g, xs, ga if p < 2 else gb, ZP)
                if IS_W13:
                    acc_u = _flush(acc_u, a_u, xs, ua if p < 2 else ub, ZP)
                a_g = zero
                a_u = zero
                xs = zero
    return acc_g, acc_u, a_g, a_u, xs


@triton.jit
def _tail32(acc_g, acc_u, a_g, a_u, xs, tb, k0, sp, NR, N, rn, mn, wrow, wmask, xrow, rk, mrow, ones,
            G: tl.constexpr, IS_W13: tl.constexpr, DEQ: tl.constexpr, ZP: tl.constexpr):
    """The k tail's last 32 k (2 planes in bytes at tb, from k0, one group): the accumulators after them."""
    tp = tb.to(tl.pointer_type(tl.uint8))
    ga, _g1, _g2, _g3, ua, _u1, _u2, _u3 = _ldsz(sp, k0 // G, NR, N, rn, mn, 1, IS_W13)
    wg = tl.load(tp + wrow, mask=wmask, other=0).to(tl.int32)
    if DEQ:
        pg = _deq4(wg, ga, ga, 0, False, ZP)
    else:
        pg = _planes4(wg, 0, False)
    if IS_W13:
        wu = tl.load(tp + N * 16 + wrow, mask=wmask, other=0).to(tl.int32)
        if DEQ:
            pu = _deq4(wu, ua, ua, 0, False, ZP)
        else:
            pu = _planes4(wu, 0, False)
    for p in tl.static_range(2):
        xt = tl.load(xrow + (k0 + p * 16 + rk)[:, None], mask=mrow[None, :], other=0.0)
        if IS_W13:
            acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p], pu[p], xt, ones,
                                               IS_W13, DEQ)
        else:
            acc_g, acc_u, a_g, a_u, xs = _step(acc_g, acc_u, a_g, a_u, xs, pg[p], pg[p], xt, ones,
                                               IS_W13, DEQ)
    if not DEQ:
        acc_g = _flush(acc_g, a_g, xs, ga, ZP)
        if IS_W13:
            acc_u = _flush(acc_u, a_u, xs, ua, ZP)
    return acc_g, acc_u


@triton.jit
def _tail(acc_g, acc_u, a_g, a_u, xs, base, w_off, sp, NR, N, K, pid_k, SPLIT, rn, mn, wrow, wmask, xrow, rk,
          mrow, ones, zero, G: tl.constexpr, PPG: tl.constexpr, IS_W13: tl.constexpr, DEQ: tl.constexpr,
          T64: tl.constexpr, T32: tl.constexpr, ZP: tl.constexpr):
    """The k tail (K % 128 = 64 and/or 32), in the last split only: (acc_g, acc_u) after it."""
    if T64 or T32:
        if pid_k == SPLIT - 1:       # the k tail (g = 32 or 64 only): groups never straddle it
            kb = K // 128
            tb = base + w_off + kb * NR * 64
            k0 = kb * 128
            if T64:
                acc_g, acc_u, a_g, a_u, xs = _tail64(acc_g, acc_u, a_g, a_u, xs, tb, k0, sp, NR, N, rn, mn, wrow,
                                                     wmask, xrow, rk, mrow, ones, zero, G, PPG, IS_W13, DEQ, ZP)
                tb = tb + NR * 32
                k0 = k0 + 64
            if T32:
                acc_g, acc_u = _tail32(acc_g, acc_u, a_g, a_u, xs, tb, k0, sp, NR, N, rn, mn, wrow, wmask, xrow, rk,
                                       mrow, ones, G, IS_W13, DEQ, ZP)
    return acc_g, acc_u


@triton.jit
def _store(acc_g, acc_u, pos, pair, rn, mn, mrow, out_ptr, stride_o, wt_ptr, part_ptr, stride_ps, pid_k, N, TOPK,
           IS_W13: tl.constexpr, SPLIT13: tl.constexpr):
    """The epilogue: h = silu(gate) * up (w13), this split's partials (split w13), or the weighted
    atomic add into acc (w2)."""
    omask = mn[:, None] & mrow[None, :]
    if IS_W13:
        if SPLIT13:
            # split-K: this split's fp32 partial sums, plain stores into part [S, pairs, 2F] (gate in
            # columns 0..F-1, up in F..2F-1); `_gate_up_kernel` adds them and writes h
            pptr = part_ptr + pid_k.to(tl.int64) * stride_ps + pos.to(tl.int64)[None, :] * (2 * N) + rn[:, None]
            tl.store(pptr, acc_g, mask=omask)
            tl.store(pptr + N, acc_u, mask=omask)
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
            optr = out_ptr + pos.to(tl.int64)[None, :] * stride_o + rn[:, None]
            tl.store(optr, h.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        wt = tl.load(wt_ptr + pair, mask=mrow, other=0.0).to(tl.float32)
        optr = out_ptr + (pair // TOPK).to(tl.int64)[None, :] * stride_o + rn[:, None]
        tl.atomic_add(optr, acc_g * wt[None, :], mask=omask, sem="relaxed")


@triton.jit(do_not_specialize=["E", "TOPK", "NCH", "UPS", "SPLIT"])
def _expert_mm(x_ptr, stride_x, pool_ptr, slot_bytes, table_ptr, E,
               seg_e_ptr, seg_s_ptr, seg_end_ptr, order_ptr, wt_ptr,
               out_ptr, stride_o, w_off, sz_off, N, K, TOPK, NCH, UPS, SPLIT, part_ptr, stride_ps,
               G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, IS_W13: tl.constexpr,
               ASM: tl.constexpr, DEQ: tl.constexpr, T64: tl.constexpr, T32: tl.constexpr,
               SPLIT13: tl.constexpr, ZP: tl.constexpr, UNR: tl.constexpr = 1, STG: tl.constexpr = None):
    """One CTA: BN weight rows of its segment's expert (gate and up rows with IS_W13) times the
    segment's chunk of BM rows, over split pid_k of K (see `moe.py`)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_k = tl.program_id(2)
    seg = pid_s // NCH
    ch = pid_s % NCH
    e = tl.load(seg_e_ptr + seg)
    if (e < 0) | (e >= E):
        return
    slot = tl.load(table_ptr + e)
    if slot < 0:
        return
    start = tl.load(seg_s_ptr + seg) + ch * BM
    end = tl.load(seg_end_ptr + seg)
    if start >= end:
        return
    rm = tl.arange(0, BM)
    pos = start + rm
    mrow = pos < end
    pair = tl.load(order_ptr + pos, mask=mrow, other=0)
    if IS_W13:
        xrow = x_ptr + (pair // TOPK).to(tl.int64)[None, :] * stride_x
        NR = 2 * N
    else:
        xrow = x_ptr + pos.to(tl.int64)[None, :] * stride_x
        NR = N
    base = pool_ptr + slot.to(tl.int64) * slot_bytes
    wp = (base + w_off).to(tl.pointer_type(tl.int32))
    sp = (base + sz_off).to(tl.pointer_type(tl.int32))
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < N
    rj = tl.arange(0, 16)
    rk = tl.arange(0, 16)
    wrow = rn[:, None] * 16 + rj[None, :]
    wmask = mn[:, None]
    ones = tl.full((BN, 16), 1.0, tl.float32).to(tl.bfloat16)
    zero = tl.zeros((BN, BM), tl.float32)
    U: tl.constexpr = 128 if G <= 128 else G        # k per unit: one block, or one group of 2 blocks
    BPU: tl.constexpr = U // 128
    PPG: tl.constexpr = G // 16                     # planes per group
    GPU: tl.constexpr = U // G                      # groups per unit (1, 2 or 4)
    acc_g, acc_u, a_g, a_u, xs = _units(wp, sp, NR, N, K, pid_k, UPS, rn, mn, wrow, wmask, xrow, rk, mrow, ones,
                                        zero, U, BPU, PPG, GPU, IS_W13, ASM, DEQ, ZP, UNR, STG)
    acc_g, acc_u = _tail(acc_g, acc_u, a_g, a_u, xs, base, w_off, sp, NR, N, K, pid_k, SPLIT, rn, mn, wrow, wmask,
                         xrow, rk, mrow, ones, zero, G, PPG, IS_W13, DEQ, T64, T32, ZP)
    _store(acc_g, acc_u, pos, pair, rn, mn, mrow, out_ptr, stride_o, wt_ptr, part_ptr, stride_ps, pid_k, N, TOPK,
           IS_W13, SPLIT13)


@triton.jit(do_not_specialize=["E", "NCH"])
def _gate_up_kernel(part_ptr, stride_ps, h_ptr, stride_h, table_ptr, E, seg_e_ptr, seg_s_ptr, seg_end_ptr,
                    N, NCH, S: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr, BF: tl.constexpr):
    """The split-K w13's second half: grid (F / BF, segments * row chunks), the w13 launch's row
    chunks (BM rows of a segment, skipped exactly where `_expert_mm` skips them, so only what it
    wrote is read), RB rows at a time: h = silu(g) * u from g, u = the sum of the S partials of
    part [S, pairs, 2F] in the order s = 0, 1, .., S-1 (deterministic), fp32, h in h's dtype."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    seg = pid_s // NCH
    ch = pid_s % NCH
    e = tl.load(seg_e_ptr + seg)
    if (e < 0) | (e >= E):
        return
    slot = tl.load(table_ptr + e)
    if slot < 0:
        return
    start = tl.load(seg_s_ptr + seg) + ch * BM
    end = tl.load(seg_end_ptr + seg)
    if start >= end:
        return
    rn = pid_n * BF + tl.arange(0, BF)
    mn = rn < N
    nsub = (tl.minimum(end - start, BM) + RB - 1) // RB       # RB divides BM: rows stay in the chunk
    for r in range(nsub):
        pos = start + r * RB + tl.arange(0, RB)
        m = (pos < end)[:, None] & mn[None, :]
        p = part_ptr + pos.to(tl.int64)[:, None] * (2 * N) + rn[None, :]
        g = tl.load(p, mask=m, other=0.0)
        u = tl.load(p + N, mask=m, other=0.0)
        for s in tl.static_range(1, S):
            q = p + s * stride_ps.to(tl.int64)
            g += tl.load(q, mask=m, other=0.0)
            u += tl.load(q + N, mask=m, other=0.0)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + pos.to(tl.int64)[:, None] * stride_h + rn[None, :], h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _route_kernel(ids_ptr, P, A, seg_e_ptr, seg_s_ptr, seg_end_ptr, order_ptr, sorted_ptr,
                  z_ptr, NZ, PP: tl.constexpr, JC: tl.constexpr, ZB: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        i = tl.arange(0, PP)
        mi = i < P
        big = 2 ** 30
        ids = tl.load(ids_ptr + i, mask=mi, other=big)
        rank = tl.zeros((PP,), tl.int32)
        for j0 in range(0, P, JC):
            j = j0 + tl.arange(0, JC)
            idj = tl.load(ids_ptr + j, mask=j < P, other=big)
            before = (idj[None, :] < ids[:, None]) | ((idj[None, :] == ids[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum(before.to(tl.int32), axis=1)
        tl.store(order_ptr + rank, i, mask=mi)
        tl.store(sorted_ptr + rank, ids, mask=mi)
        a = tl.arange(0, PP)
        tl.store(seg_e_ptr + a, tl.full((PP,), -1, tl.int32), mask=a < A)
        tl.debug_barrier()
        se = tl.load(sorted_ptr + i, mask=mi, other=-1)
        sprev = tl.load(sorted_ptr + i - 1, mask=mi & (i > 0), other=-1)
        snext = tl.load(sorted_ptr + i + 1, mask=(i + 1) < P, other=-1)
        first = mi & ((i == 0) | (se != sprev))
        last = mi & (((i + 1) == P) | (se != snext))
        seg = tl.cumsum(first.to(tl.int32), axis=0) - 1
        ok = seg < A
        tl.store(seg_e_ptr + seg, se, mask=first & ok)
        tl.store(seg_s_ptr + seg, i, mask=first & ok)
        tl.store(seg_end_ptr + seg, i + 1, mask=last & ok)
    offs = pid * ZB + tl.arange(0, ZB)
    tl.store(z_ptr + offs, tl.zeros((ZB,), tl.float32), mask=offs < NZ)
