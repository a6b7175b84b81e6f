"""The routed experts of one MoE layer, straight from the pool slots, in Triton.

Four launches back to back (five with split-K of w13), no host sync (CUDA-graph safe with a fixed
Workspace per batch size):

1. `_route_kernel` (one program does the routing, all programs zero the fp32 accumulator): the
   (row, j) pairs sorted by expert, stably, and one segment per distinct expert (id, start, end).
2. `_expert_mm` with IS_W13: grid (F / BN, segments * row chunks, S = split13). A CTA reads BN
   gate rows and the BN matching up rows of its segment's expert from the slot (slot table -> pool
   row) over 1/S of K = H. S = 1: it writes silu(gate) * up in bf16 into h [pairs, F], rows in
   sorted order. S > 1 (at small M there are only F / BN CTAs of work otherwise): it stores its
   fp32 partial gate and up sums, plain stores, into Workspace.part [S, pairs, 2F] (no atomics, no
   counters: every element written once), and 2b. `_gate_up_kernel` (grid F / BF x the same
   segments * row chunks, skipping exactly what w13 skips) adds the S partials in the order
   s = 0..S-1, applies silu(g) * u in fp32 as the unsplit path does and writes h: deterministic,
   and h differs from the unsplit one only by the order of the fp32 sums.
3. `_expert_mm` without IS_W13: grid (H / BN, segments * row chunks, SPLIT): a CTA reads BN rows
   of w2 over 1/SPLIT of K = F, multiplies the segment's rows of h, scales by each pair's routing
   weight and adds into acc [M, H] fp32 with atomics (split-K and the sum over the k experts).
4. acc -> out dtype (a torch copy).

Both split-Ks cut K the same way (`k_split`): into whole k-units of max(128, g) (whole tiled
blocks and whole groups), ceil(units / S) units a split, the k tail (K % 128, g = 32/64) in the
last split; an uneven split is fine (the last one has fewer units), and S is capped so that no
split is empty.

The inner step is a tensor-core dot per 16-k "plane" with the weights as the A operand
(out^T [BN, BM] = W [BN, 16] @ x^T [16, BM], rows padded to BM >= 16): one int32 word holds 8
planes' codes for the same (row, k), so a 16-byte load feeds 4 k-columns of 8 planes; a plane is
((w >> 4p) & 0xF) | 0x4300 read as bf16, which is 128 + q exactly (with ASM, two words become a
bf16 pair per plane in two instructions: prmt, lop3). Two ways to apply the affine part:
- DEQ: (q - 8) * s + z to bf16 in registers (two bf16x2 fma a pair, one rounding, as tinygemm
  rounds), every plane's dot into one fp32 accumulator;
- not DEQ: exact, per group in fp32 on the dot results: y = s * dot(128 + q, x) + (z - 136 s) * sum(x),
  the sum from a dot with ones.
With ZP (a `-fp16` format: fp16 (scale, zero point) pairs, GPTQ and AWQ as stored) a pair becomes
fp32 (s, (8 - zp) * s), exact, and both ways compute as above in fp32; DEQ then takes the plain
path (no inline PTX: its bf16x2 fma would round s and z). Without ZP the code is unchanged.
Scales are prefetched one k-unit ahead (their loads would otherwise stall every unit); weights and
x tiles stream through Triton's cp.async pipeline. Accumulation is fp32 throughout. Which of these
is fastest depends on M (CONFIGS); with 32 weight rows per warp Triton keeps the unpacked operand
in registers and uses mma.sync, which beat its wgmma code here (that waits after every wgmma).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Two int32 words (a, b) -> 4 bf16 pairs: plane p of a in the low half, of b in the high half,
# each 0x4300 | q = 128 + q. prmt 0x5410 puts the low 16 bits of a and b side by side (planes 0-3),
# 0x7632 the high 16 bits (planes 4-7); lop3 0xEA is (x & m) | c.
_ASM_LO = tl.constexpr("""{
.reg .b32 v, t;
prmt.b32 v, $4, $5, 0x5410;
lop3.b32 $0, v, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 4;
lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 8;
lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 12;
lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;
}""")
_ASM_HI = tl.constexpr("""{
.reg .b32 v, t;
prmt.b32 v, $4, $5, 0x7632;
lop3.b32 $0, v, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 4;
lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 8;
lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, v, 12;
lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xEA;
}""")


# Triton's CPU interpreter multiplies bf16 operands of tl.dot wrongly: upcast there (tests only).
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _mma(a, b, acc):
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _plane(w, P: tl.constexpr):
    v = ((w >> (4 * P)) & 0xF) | 0x4300
    return v.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _planes4(w, HI: tl.constexpr, ASM: tl.constexpr):
    """Planes 0-3 (HI=0) or 4-7 (HI=1) of int32 words, as bf16 128 + q."""
    if ASM:
        if HI:
            r = tl.inline_asm_elementwise(_ASM_HI, "=r,=r,=r,=r,r,r", [w],
                                          dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                          is_pure=True, pack=2)
        else:
            r = tl.inline_asm_elementwise(_ASM_LO, "=r,=r,=r,=r,r,r", [w],
                                          dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                          is_pure=True, pack=2)
    else:
        r = (_plane(w, 4 * HI), _plane(w, 4 * HI + 1), _plane(w, 4 * HI + 2), _plane(w, 4 * HI + 3))
    return r


# With DEQ: two words and the (scale, zero) int32 of their rows for planes 0-1 (A) and 2-3 (B) of
# the half -> 4 bf16 pairs of dequantized weights (q - 8) * s + z, one rounding (fma), in 5
# instructions a pair: lop3 makes 128 + q, fma with (1, -136) makes q - 8 exactly, fma with (s, z).
_DQ_HEAD = """{
.reg .b32 v, t, sa, za, sb, zb, one, m136;
mov.b32 one, 0x3F803F80;
mov.b32 m136, 0xC308C308;
prmt.b32 sa, $6, $7, 0x5410;
prmt.b32 za, $6, $7, 0x7632;
prmt.b32 sb, $8, $9, 0x5410;
prmt.b32 zb, $8, $9, 0x7632;
"""
_DQ_BODY = """lop3.b32 t, v, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, m136;
fma.rn.bf16x2 $0, t, sa, za;
shr.u32 t, v, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, m136;
fma.rn.bf16x2 $1, t, sa, za;
shr.u32 t, v, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, m136;
fma.rn.bf16x2 $2, t, sb, zb;
shr.u32 t, v, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, m136;
fma.rn.bf16x2 $3, t, sb, zb;
}"""
_ASM_DQ_LO = tl.constexpr(_DQ_HEAD + "prmt.b32 v, $4, $5, 0x5410;\n" + _DQ_BODY)
_ASM_DQ_HI = tl.constexpr(_DQ_HEAD + "prmt.b32 v, $4, $5, 0x7632;\n" + _DQ_BODY)


@triton.jit
def _sz_f32(sz, ZP: tl.constexpr):
    """(scale, zero) fp32 of pairs read as int32: bf16 (scale, zero), or with ZP fp16 (scale, zero
    point) -> (s, (8 - zp) * s), exact in fp32."""
    if ZP:
        s = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        zp = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        r = (s, (8.0 - zp) * s)
    else:
        r = ((sz << 16).to(tl.float32, bitcast=True), (sz & -65536).to(tl.float32, bitcast=True))
    return r


@triton.jit
def _deq1(w, P: tl.constexpr, sz, ZP: tl.constexpr):
    s, z = _sz_f32(sz, ZP)
    v = _plane(w, P).to(tl.float32) - 136.0
    return (v * s[:, None] + z[:, None]).to(tl.bfloat16)


@triton.jit
def _deq4(w, sza, szb, HI: tl.constexpr, ASM: tl.constexpr, ZP: tl.constexpr):
    """Planes 0-3 (HI=0) or 4-7 (HI=1) dequantized to bf16; sza holds the (scale, zero) of the
    first two planes' group, szb of the last two, int32 [BN]. ZP: fp32 math, never the PTX."""
    if ZP:
        r = (_deq1(w, 4 * HI, sza, ZP), _deq1(w, 4 * HI + 1, sza, ZP), _deq1(w, 4 * HI + 2, szb, ZP),
             _deq1(w, 4 * HI + 3, szb, ZP))
    elif ASM:
        a2 = tl.broadcast_to(sza[:, None], w.shape)
        b2 = tl.broadcast_to(szb[:, None], w.shape)
        if HI:
            r = tl.inline_asm_elementwise(_ASM_DQ_HI, "=r,=r,=r,=r,r,r,r,r,r,r", [w, a2, b2],
                                          dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                          is_pure=True, pack=2)
        else:
            r = tl.inline_asm_elementwise(_ASM_DQ_LO, "=r,=r,=r,=r,r,r,r,r,r,r", [w, a2, b2],
                                          dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                          is_pure=True, pack=2)
    else:
        r = (_deq1(w, 4 * HI, sza, ZP), _deq1(w, 4 * HI + 1, sza, ZP), _deq1(w, 4 * HI + 2, szb, ZP),
             _deq1(w, 4 * HI + 3, szb, ZP))
    return r


@triton.jit
def _pick4(Q: tl.constexpr, a0, a1, a2, a3):
    if Q == 0:
        r = a0
    elif Q == 1:
        r = a1
    elif Q == 2:
        r = a2
    else:
        r = a3
    return r


@triton.jit
def _ldsz(sp, grp, NR, N, rn, m, GPU: tl.constexpr, IS_W13: tl.constexpr):
    """(scale, zero) int32 [BN] of groups grp .. grp+GPU-1 (up to 4), gate rows then up rows."""
    p = sp + grp * NR + rn
    g0 = tl.load(p, mask=m, other=0)
    g1 = g0
    g2 = g0
    g3 = g0
    if GPU > 1:
        g1 = tl.load(p + NR, mask=m, other=0)
    if GPU > 2:
        g2 = tl.load(p + 2 * NR, mask=m, other=0)
        g3 = tl.load(p + 3 * NR, mask=m, other=0)
    u0 = g0
    if IS_W13:
        u0 = tl.load(p + N, mask=m, other=0)
    u1 = u0                       # unused groups repeat the first (the tails read group 1 as group 0)
    u2 = u0
    u3 = u0
    if IS_W13:
        if GPU > 1:
            u1 = tl.load(p + NR + N, mask=m, other=0)
        if GPU > 2:
            u2 = tl.load(p + 2 * NR + N, mask=m, other=0)
            u3 = tl.load(p + 3 * NR + N, mask=m, other=0)
    return g0, g1, g2, g3, u0, u1, u2, u3


@triton.jit
def _flush(acc, a, xs, sz, ZP: tl.constexpr):
    """acc + s * a + (z - 136 s) * xs for (scale, zero) pairs read as int32 [BN] (see _sz_f32)."""
    s, z = _sz_f32(sz, ZP)
    return acc + a * s[:, None] + (z - 136.0 * s)[:, None] * xs


@triton.jit
def _step(acc_g, acc_u, a_g, a_u, xs, pg, pu, xt, ones, IS_W13: tl.constexpr, DEQ: tl.constexpr):
    """One 16-k plane: with DEQ the dequantized plane into the accumulators; else 128 + q into the
    group's partial dots, and sum(x) by a dot with ones."""
    if DEQ:
        acc_g = _mma(pg, xt, acc_g)
        if IS_W13:
            acc_u = _mma(pu, xt, acc_u)
    else:
        a_g = _mma(pg, xt, a_g)
        if IS_W13:
            a_u = _mma(pu, xt, a_u)
        xs = _mma(ones, xt, xs)
    return acc_g, acc_u, a_g, a_u, xs


@triton.jit(do_not_specialize=["E", "TOPK", "NCH", "UPS", "SPLIT"])
def _expert_mm(x_ptr, stride_x, pool_ptr, slot_bytes, table_ptr, E,
               seg_e_ptr, seg_s_ptr, seg_end_ptr, order_ptr, wt_ptr,
               out_ptr, stride_o, w_off, sz_off, N, K, TOPK, NCH, UPS, SPLIT, part_ptr, stride_ps,
               G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, IS_W13: tl.constexpr,
               ASM: tl.constexpr, DEQ: tl.constexpr, T64: tl.constexpr, T32: tl.constexpr,
               SPLIT13: tl.constexpr, ZP: tl.constexpr):
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
    acc_g = zero
    acc_u = zero
    a_g = zero
    a_u = zero
    xs = zero
    U: tl.constexpr = 128 if G <= 128 else G        # k per unit: one block, or one group of 2 blocks
    BPU: tl.constexpr = U // 128
    PPG: tl.constexpr = G // 16                     # planes per group
    GPU: tl.constexpr = U // G                      # groups per unit (1, 2 or 4)
    n_units = K // U
    u_lo = pid_k * UPS
    u_hi = tl.minimum(n_units, u_lo + UPS)
    # the scales of the next unit are loaded one unit ahead (their latency hides behind a unit)
    sg0, sg1, sg2, sg3, su0, su1, su2, su3 = _ldsz(sp, u_lo * GPU, NR, N, rn, mn & (u_lo < u_hi), GPU, IS_W13)
    for u in range(u_lo, u_hi):
        cg0, cg1, cg2, cg3, cu0, cu1, cu2, cu3 = sg0, sg1, sg2, sg3, su0, su1, su2, su3
        sg0, sg1, sg2, sg3, su0, su1, su2, su3 = _ldsz(sp, (u + 1) * GPU, NR, N, rn, mn & (u + 1 < u_hi),
                                                       GPU, IS_W13)
        for b in tl.static_range(BPU):
            kb = u * BPU + b
            blk = wp + kb * NR * 16
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
    if T64 or T32:
        if pid_k == SPLIT - 1:       # the k tail (g = 32 or 64 only): groups never straddle it
            kb = K // 128
            tb = base + w_off + kb * NR * 64
            k0 = kb * 128
            if T64:
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
                tb = tb + NR * 32
                k0 = k0 + 64
            if T32:
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


# --- host side -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    bm: int              # rows per CTA (padded, >= 16): a segment with more rows takes several chunks
    bn13: int            # gate (and up) rows per CTA in the w13 kernel
    warps13: int
    stages13: int
    bn2: int             # w2 rows per CTA
    split2: int          # split-K of the w2 kernel
    warps2: int
    stages2: int
    asm: bool = True     # unpacking (and dequantizing) by inline PTX
    deq: bool = True     # w13: dequantize to bf16 in registers, one accumulator (else fp32 affine per group)
    deq2: bool = True    # the same for w2
    split13: int = 1     # split-K of w13 (partials in Workspace.part, summed by `_gate_up_kernel`)


# by batch rows M (the smallest bucket >= M): the configurations benchmarks/expert_kernel_h200.py
# chose on the H200 (2026-12-01; each checked against the fp32 reference on a Mixtral layer and
# expert, then the fastest layer among the correct candidates). 32 rows per warp keeps the
# unpacked operand in registers (mma.sync); 4 warps and BN >= 64 make Triton use wgmma.
CONFIGS: dict[int, KernelConfig] = {
    1: KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False),
    2: KernelConfig(16, 64, 2, 3, 128, 16, 4, 3, deq=False, deq2=True),
    4: KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False),
    8: KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False),
    16: KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False),
    32: KernelConfig(32, 64, 2, 3, 128, 16, 4, 3, deq=True, deq2=True),
    64: KernelConfig(64, 64, 4, 3, 128, 8, 4, 3, deq=False, deq2=True),
}


def pick_config(M: int) -> KernelConfig:
    for b in sorted(CONFIGS):
        if M <= b:
            return CONFIGS[b]
    return CONFIGS[max(CONFIGS)]


class Workspace:
    """Scratch buffers for one (M, k, H, F, E) on one device: allocate once, reuse on every call
    (and inside CUDA graphs). `out` and `acc` are overwritten by the next call; `part` (split-K
    of w13 only) is allocated by the first call that splits w13 (see split_buffers)."""

    def __init__(self, M: int, topk: int, hidden: int, ffn: int, num_experts: int, device, dtype=torch.bfloat16):
        P = M * topk
        self.key = (M, topk, hidden, ffn, num_experts, torch.device(device), dtype)
        self.P, self.A = P, min(P, num_experts + 1)
        i32 = dict(dtype=torch.int32, device=device)
        self.order = torch.empty(P, **i32)
        self.sorted = torch.empty(P, **i32)
        self.seg_e = torch.empty(self.A, **i32)
        self.seg_s = torch.empty(self.A, **i32)
        self.seg_end = torch.empty(self.A, **i32)
        self.h = torch.empty(P, ffn, dtype=dtype, device=device)
        self.acc = torch.empty(M, hidden, dtype=torch.float32, device=device)
        self.out = torch.empty(M, hidden, dtype=dtype, device=device)
        self.part = None                     # split-K of w13 only: see split_buffers

    def split_buffers(self, splits: int) -> torch.Tensor:
        """fp32 [S >= splits, P, 2F]: the partial gate and up sums of w13's splits (gate in columns
        0..F-1, up in F..2F-1; rows in sorted order, as h). Allocated on the first call that needs
        it (or more splits), never zeroed: every element the reduction reads was stored by the same
        call's w13 launch. Call with the largest split before capturing a CUDA graph (a warm-up
        call does it), so that the capture does not allocate."""
        if self.part is None or self.part.shape[0] < splits:
            self.part = torch.empty(splits, self.P, 2 * self.h.shape[1], dtype=torch.float32,
                                    device=self.h.device)
        return self.part


_WS: dict[tuple, Workspace] = {}

def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# pairs above this are routed by torch ops (`moe_kernel.route_into`), not `_route_kernel`: that kernel holds
# all P pairs in one program (a [P, 64] compare per step), and its compile grows with P; on the
# H200 the calibration's 2048-token prefill (4,096 pairs) spent ~150 s in Triton's compiler
ROUTE_KERNEL_MAX_PAIRS = 512


def launch_route(ws: Workspace, topk_ids: torch.Tensor) -> None:
    P = ws.P
    if P > ROUTE_KERNEL_MAX_PAIRS:
        from cmoe.executor.moe_kernel import route_into
        route_into(topk_ids, ws.order, ws.sorted, ws.seg_e, ws.seg_s, ws.seg_end)
        ws.acc.zero_()
        return
    PP = max(16, _next_pow2(P))
    ZB = 4096
    nz = ws.acc.numel()
    _route_kernel[(max(1, triton.cdiv(nz, ZB)),)](
        topk_ids, P, ws.A, ws.seg_e, ws.seg_s, ws.seg_end, ws.order, ws.sorted, ws.acc, nz,
        PP=PP, JC=min(PP, 64), ZB=ZB, num_warps=4)


def _run(kernel, grid, args, kw, warmup: bool):
    if warmup:                      # compile only (e.g. under triton.AsyncCompileMode)
        return kernel.warmup(*args, grid=grid, **kw)
    return kernel[grid](*args, **kw)


def k_split(K: int, group: int, want: int) -> tuple[int, int]:
    """(splits, units per split) of a K = `K` reduction split `want` ways, for both kernels.

    The unit of the split is the kernels' k-unit, U = max(128, group) k: whole BLOCK_K blocks of
    the tiled layout and whole groups (g <= 128 divides 128; g = 256 is one unit of two blocks),
    so no split starts inside a block or a group and each split's affine part is complete. Split
    s covers units [s * ups, min(units, (s + 1) * ups)); the k tail (K % 128 = 32, 64, 96, only
    g = 32, 64) goes to the last split. Uneven splits are allowed: ups = ceil(units / want), and
    the count is then reduced to ceil(units / ups), so every split has at least one unit (a split
    never exceeds the units; K < 128, only a tail, is one split)."""
    units = K // max(128, group)
    split = max(1, min(want, units))
    ups = triton.cdiv(units, split)
    if units:
        split = triton.cdiv(units, ups)
    return split, ups


def launch_w13(ws: Workspace, x, slot_table, pool, layout, topk: int, cfg: KernelConfig, warmup=False):
    """gate/up with SiLU into ws.h; with split13 > 1 two launches (the split w13, its reduction).
    Returns the w13 launch's kernel (with warmup: both are compiled)."""
    H, Fd = layout.hidden, layout.ffn
    E = slot_table.numel()
    M = x.shape[0]
    nch = triton.cdiv(M, cfg.bm)
    t = H % 128
    split, ups = k_split(H, layout.group, cfg.split13)
    tiles = triton.cdiv(Fd, cfg.bn13)
    part = ws.split_buffers(split) if split > 1 else ws.acc
    args = (x, x.stride(0), pool, pool.stride(0), slot_table, E,
            ws.seg_e, ws.seg_s, ws.seg_end, ws.order, ws.order,
            ws.h, ws.h.stride(0), layout.part("w13").offset, layout.part("w13_sz").offset,
            Fd, H, topk, nch, ups, split, part, part.stride(0))
    kw = dict(G=layout.group, BN=cfg.bn13, BM=cfg.bm, IS_W13=True, ASM=cfg.asm, DEQ=cfg.deq,
              T64=t >= 64, T32=t % 64 == 32, SPLIT13=split > 1, ZP=layout.zero_point, num_warps=cfg.warps13,
              num_stages=cfg.stages13)
    k13 = _run(_expert_mm, (tiles, ws.A * nch, split), args, kw, warmup)
    if split > 1:
        # RB rows a step (a segment has <= M rows; a loop covers the chunk), ~1024 elements a CTA and
        # 4 a thread: all S partials' loads are issued at once (S * 8 registers a thread, no spills)
        rb = min(cfg.bm, _next_pow2(M))
        bf = min(_next_pow2(Fd), 512, max(32, 1024 // rb))
        args = (part, part.stride(0), ws.h, ws.h.stride(0), slot_table, E, ws.seg_e, ws.seg_s, ws.seg_end,
                Fd, nch)
        kw = dict(S=split, BM=cfg.bm, RB=rb, BF=bf, num_warps=max(1, min(8, rb * bf // 128)))
        _run(_gate_up_kernel, (triton.cdiv(Fd, bf), ws.A * nch), args, kw, warmup)
    return k13


def launch_w2(ws: Workspace, topk_weights, slot_table, pool, layout, topk: int, M: int, cfg: KernelConfig,
              warmup=False):
    H, Fd = layout.hidden, layout.ffn
    E = slot_table.numel()
    nch = triton.cdiv(M, cfg.bm)
    split, ups = k_split(Fd, layout.group, cfg.split2)
    t = Fd % 128
    args = (ws.h, ws.h.stride(0), pool, pool.stride(0), slot_table, E,
            ws.seg_e, ws.seg_s, ws.seg_end, ws.order, topk_weights,
            ws.acc, ws.acc.stride(0), layout.part("w2").offset, layout.part("w2_sz").offset,
            H, Fd, topk, nch, ups, split, ws.acc, 0)
    kw = dict(G=layout.group, BN=cfg.bn2, BM=cfg.bm, IS_W13=False, ASM=cfg.asm, DEQ=cfg.deq2,
              T64=t >= 64, T32=t % 64 == 32, SPLIT13=False, ZP=layout.zero_point, num_warps=cfg.warps2,
              num_stages=cfg.stages2)
    return _run(_expert_mm, (triton.cdiv(H, cfg.bn2), ws.A * nch, split), args, kw, warmup)


def moe_triton(x, topk_ids, topk_weights, slot_table, pool, layout, workspace=None, config=None, out_dtype=None):
    """See cmoe.executor.moe_kernel.moe_forward."""
    M, H = x.shape
    topk = topk_ids.shape[1]
    assert H == layout.hidden and layout.group, (H, layout)
    assert x.stride(1) == 1 and pool.dim() == 2 and pool.stride(1) == 1 and pool.dtype == torch.uint8
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and topk_weights.is_contiguous()
    assert slot_table.dtype == torch.int32
    E = slot_table.numel()
    ws = workspace
    if ws is None:
        key = (M, topk, H, layout.ffn, E, x.device, x.dtype)
        ws = _WS.get(key)
        if ws is None:
            ws = _WS[key] = Workspace(M, topk, H, layout.ffn, E, x.device, x.dtype)
    cfg = config or pick_config(M)
    launch_route(ws, topk_ids)
    launch_w13(ws, x, slot_table, pool, layout, topk, cfg)
    launch_w2(ws, topk_weights, slot_table, pool, layout, topk, M, cfg)
    if out_dtype == torch.float32:
        return ws.acc
    ws.out.copy_(ws.acc)
    return ws.out if out_dtype in (None, x.dtype) else ws.out.to(out_dtype)
