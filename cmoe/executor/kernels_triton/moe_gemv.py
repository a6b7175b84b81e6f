"""The expert matmuls on CUDA cores, for the few rows a decode step gives each expert (issue 14).

`_expert_gemv` computes what `moe_device._expert_mm` computes (the same grid, segments, slot
table, splits and epilogue, `_store`), reading the same tiled slot bytes, but without tensor cores.
Why: a tensor-core dot pads a segment's rows to 16, so at one row 15/16 of its math is padding, and
on the H200 the committed mma kernel is bound by its instructions per byte, not by the memory
(BENCHMARKS.md: 2.07 TB/s for one expert at M = 1, while a stream of the same bytes and grid,
pipelined, reaches 3.7). Here each weight nibble costs about three instructions per row chunk:
one or two to make an fp32 128 + q straight from the word's bits (the nibble moved to bits 16-19
and ORed with 0x43000000, whose fp32 value is then exactly 128 + q), and one fma per row.

Per CTA: BN weight rows (and their BN up rows for w13) times BM rows of the segment, 3-D tiles
[BN, BM, 16] (16 = the words of a row in a k-block, one k-column each). For each plane p of a
k-block the codes of 16 consecutive k (k = 128 b + 16 p + j) meet x[k] for the chunk's rows:
a[n, m, j] += (128 + q) x[m, k]; the group's x sums xs[m, j] += x[m, k]. At each group's end
acc += s * a + (z - 136 s) * xs, exact affine per group in fp32 as the mma kernel's non-DEQ path
(w = (q - 8) s + z = s (128 + q) - 136 s + z); the sum over j happens once, at the end. The
k-unit loop names its stages (`STG`): a loop without a dot is pipelined only then.

No k tails (K % 128 != 0, toy shapes with g = 32 or 64): `moe.launch_*` use `_expert_mm` there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cmoe.executor.kernels_triton.moe_dequant import _INTERPRET, _sz_f32
from cmoe.executor.kernels_triton.moe_device import _store


@triton.jit
def _f32plane(w, P: tl.constexpr):
    """Plane P's codes of int32 words as fp32 128 + q: the nibble moved to bits 16-19 under the
    exponent of 128 (a shift and an and-or; no shift for P = 4)."""
    if P == 4:
        v = w & 0x000F0000
    elif P > 4:
        v = (w >> (4 * P - 16)) & 0x000F0000
    else:
        v = (w << (16 - 4 * P)) & 0x000F0000
    return (v | 0x43000000).to(tl.float32, bitcast=True)


# One int32 word -> its 8 planes as fp32 128 + q, in 15 instructions: ptxas does not merge the
# and and the or of `_f32plane` (two 32-bit immediates), so the PTX names lop3 (x & m) | c itself.
_ASM_F32 = tl.constexpr("""{
.reg .b32 t;
shl.b32 t, $8, 16;
lop3.b32 $0, t, 0x000F0000, 0x43000000, 0xEA;
shl.b32 t, $8, 12;
lop3.b32 $1, t, 0x000F0000, 0x43000000, 0xEA;
shl.b32 t, $8, 8;
lop3.b32 $2, t, 0x000F0000, 0x43000000, 0xEA;
shl.b32 t, $8, 4;
lop3.b32 $3, t, 0x000F0000, 0x43000000, 0xEA;
lop3.b32 $4, $8, 0x000F0000, 0x43000000, 0xEA;
shr.u32 t, $8, 4;
lop3.b32 $5, t, 0x000F0000, 0x43000000, 0xEA;
shr.u32 t, $8, 8;
lop3.b32 $6, t, 0x000F0000, 0x43000000, 0xEA;
shr.u32 t, $8, 12;
lop3.b32 $7, t, 0x000F0000, 0x43000000, 0xEA;
}""")


@triton.jit
def _f32planes(w, ASM: tl.constexpr):
    """All 8 planes of int32 words as fp32 128 + q (a tuple, plane 0 first)."""
    if ASM and not _INTERPRET:
        r = tl.inline_asm_elementwise(_ASM_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
                                      is_pure=True, pack=1)
    else:
        r = (_f32plane(w, 0), _f32plane(w, 1), _f32plane(w, 2), _f32plane(w, 3), _f32plane(w, 4),
             _f32plane(w, 5), _f32plane(w, 6), _f32plane(w, 7))
    return r


@triton.jit
def _flush2(acc, a, xs, sz, ZP: tl.constexpr):
    """acc + s sum_j(a) + (z - 136 s) sum_j(xs), [BN, BM], per weight row's (scale, zero) pair read
    as int32 [BN, 1]. Summing over j before scaling keeps the [BN] pairs out of the 3-D tiles' layout
    (scaled there, Triton gives the tiles the pairs' one-row-a-thread layout, and every thread then
    converts and adds all 16 of a plane's x)."""
    s, z = _sz_f32(sz, ZP)
    return acc + tl.sum(a, axis=2) * s + tl.sum(xs, axis=2) * (z - 136.0 * s)


@triton.jit
def _gemv_units(wp, sp, NR, N, K, pid_k, UPS, rn2, mn2, mn3, w3, xrow3, rj3, mrow3, zero3, zx3, zero2,
                BPU: tl.constexpr, PPG: tl.constexpr, GPU: tl.constexpr, IS_W13: tl.constexpr,
                ZP: tl.constexpr, STG: tl.constexpr, ASM: tl.constexpr):
    """Split pid_k's whole k-units (UPS a split, U = BPU * 128 k each): (acc_g, acc_u) [BN, BM]."""
    acc_g = zero2
    acc_u = zero2
    n_units = K // (BPU * 128)
    u_lo = pid_k * UPS
    u_hi = tl.minimum(n_units, u_lo + UPS)
    # STG = 1 (one block a unit): no cp.async; the next unit's words are loaded into registers
    # before this unit's are used
    PF: tl.constexpr = (STG == 1) and (BPU == 1)
    nx_g = tl.load(wp + u_lo * NR * 16 + w3, mask=mn3 & (u_lo < u_hi) & PF, other=0)
    nx_u = nx_g
    if IS_W13:
        nx_u = tl.load(wp + u_lo * NR * 16 + N * 16 + w3, mask=mn3 & (u_lo < u_hi) & PF, other=0)
    for u in tl.range(u_lo, u_hi, num_stages=STG):
        a_g = zero3
        a_u = zero3
        xs = zx3
        if PF:
            cur_g = nx_g
            cur_u = nx_u
            more = mn3 & (u + 1 < u_hi)
            nx_g = tl.load(wp + (u + 1) * NR * 16 + w3, mask=more, other=0)
            if IS_W13:
                nx_u = tl.load(wp + (u + 1) * NR * 16 + N * 16 + w3, mask=more, other=0)
        for b in tl.static_range(BPU):
            kb = u * BPU + b
            blk = wp + kb * NR * 16
            if PF:
                wg = cur_g
                wu = cur_u
            else:
                wg = tl.load(blk + w3, mask=mn3, other=0)
                wu = wg
                if IS_W13:
                    wu = tl.load(blk + N * 16 + w3, mask=mn3, other=0)
            pg = _f32planes(wg, ASM)
            pu = pg
            if IS_W13:
                pu = _f32planes(wu, ASM)
            for p in tl.static_range(8):
                xp = tl.load(xrow3 + (kb * 128 + p * 16) + rj3, mask=mrow3, other=0.0).to(tl.float32)
                a_g += pg[p] * xp
                if IS_W13:
                    a_u += pu[p] * xp
                xs += xp
                if (b * 8 + p + 1) % PPG == 0:
                    grp = u * GPU + (b * 8 + p) // PPG
                    szp = sp + grp * NR + rn2
                    acc_g = _flush2(acc_g, a_g, xs, tl.load(szp, mask=mn2, other=0), ZP)
                    if IS_W13:
                        acc_u = _flush2(acc_u, a_u, xs, tl.load(szp + N, mask=mn2, other=0), ZP)
                    a_g = zero3
                    a_u = zero3
                    xs = zx3
    return acc_g, acc_u


@triton.jit(do_not_specialize=["E", "TOPK", "NCH", "UPS", "SPLIT"])
def _expert_gemv(x_ptr, stride_x, pool_ptr, slot_bytes, table_ptr, E,
                 seg_e_ptr, seg_s_ptr, seg_end_ptr, order_ptr, wt_ptr,
                 out_ptr, stride_o, w_off, sz_off, N, K, TOPK, NCH, UPS, SPLIT, part_ptr, stride_ps,
                 G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, IS_W13: tl.constexpr,
                 SPLIT13: tl.constexpr, ZP: tl.constexpr, STG: tl.constexpr,
                 ASM: tl.constexpr = True):
    """One CTA: BN weight rows of its segment's expert (gate and up rows with IS_W13) times the
    segment's chunk of BM rows, over split pid_k of K; arguments as `_expert_mm`'s."""
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
        xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
        NR = 2 * N
    else:
        xrow = x_ptr + pos.to(tl.int64) * stride_x
        NR = N
    base = pool_ptr + slot.to(tl.int64) * slot_bytes
    wp = (base + w_off).to(tl.pointer_type(tl.int32))
    sp = (base + sz_off).to(tl.pointer_type(tl.int32))
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < N
    rn3 = rn[:, None, None]
    mn3 = mn[:, None, None]
    rj3 = tl.arange(0, 16)[None, None, :]
    w3 = rn3 * 16 + rj3                                    # [BN, 1, 16]
    xrow3 = xrow[None, :, None]                            # [1, BM, 1]
    mrow3 = mrow[None, :, None]
    zero3 = tl.zeros((BN, BM, 16), tl.float32)
    zx3 = tl.zeros((1, BM, 16), tl.float32)
    U: tl.constexpr = 128 if G <= 128 else G
    acc_g, acc_u = _gemv_units(wp, sp, NR, N, K, pid_k, UPS, rn[:, None], mn[:, None], mn3, w3, xrow3, rj3, mrow3,
                               zero3, zx3, tl.zeros((BN, BM), tl.float32), U // 128, G // 16, U // G, IS_W13, ZP,
                               STG, ASM)
    _store(acc_g, acc_u, pos, pair, rn, mn, mrow, out_ptr, stride_o, wt_ptr,
           part_ptr, stride_ps, pid_k, N, TOPK, IS_W13, SPLIT13)
