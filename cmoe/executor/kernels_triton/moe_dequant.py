"""Device helpers of the MoE expert kernels (`moe_device._expert_mm`): unpacking the int4 planes of
the tiled layout, dequantizing them, loading the (scale, zero) pairs of a k-unit, and one plane's
tensor-core step. All are @triton.jit (inlined into the kernel); see `moe.py` for the scheme.
"""

from __future__ import annotations

import os

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
