// The routed experts' matmuls of one MoE layer, read straight from the pool slots: CUDA C++ for
// NVRTC (cmoe/executor/kernels_cuda/moe.py compiles it, one binary per set of the macros below).
//
// One kernel, two roles (IS_W13): gate/up with SiLU into h, or down with the routing weights
// added into the fp32 accumulator by atomics. It reads the same tiled slot bytes, segments and
// slot table as the Triton kernel (kernels_triton/moe.py describes them) and writes the same h and
// acc, so the two are interchangeable per launch.
//
// Why another kernel: at one batch row the Triton kernel stops near 2.1 TB/s, and the compiled
// loop spends ~4.5x the instructions per byte of a pure stream of the same bytes (x tiles through
// shared memory and ldmatrix, barriers every plane). Here nothing goes through shared memory until
// the epilogue:
// - each thread loads its 16 bytes of a 128-k block's row straight into registers (LDG.128, four
//   lanes cover a row's 64 bytes, a warp 16 rows: 1 KB contiguous), the next k-unit's loads issued
//   before the current one is used;
// - the tensor-core A operand is built in registers: the mma's k slots (2c, 2c+1, 2c+8, 2c+9) of
//   lane c are mapped onto the words 4c..4c+3 the lane loaded (any one-to-one map of k slots is
//   allowed when A and B use the same), so a plane's pair of codes is one prmt and one lop3
//   (+ one shift for odd planes) into bf16x2 (128 + q, exact), no shuffles;
// - the B operand is x itself (or h), read by each lane from global memory (L1-resident) in the
//   same slot order: the 4 bf16 at k = 16p + 4c .. 4c+3 are one 8-byte load;
// - the affine part per group is exact in fp32: y = s * dot(128 + q, x) + (z - 136 s) * sum(x),
//   sum(x) by an mma with A = ones (as the Triton kernel's exact path does);
// - the CTA's NW warps take the k-units in turn (split-K inside the CTA) and add their fp32 parts
//   in shared memory in warp order at the end (deterministic); the w2 role may also split K over
//   grid z (atomics into acc, as the Triton kernel does).
//
// Macros (set by the host): IS_W13, G (group: 32, 64, 128, 256), NW (warps a CTA), MT (16-row
// tiles a warp in the w2 role; w13 always one gate and one up tile), ZP (fp16 (scale, zero point)
// pairs), WT_BF16 (routing weights in bf16, else fp32), XPF (x loaded with its unit's weights, else
// per block when computed), PDL (sm_90+, programmatic dependent launch: the w13 role lets the next
// grid start at once; the w2 role, launched as that dependent, loads its first two units' weights,
// then waits for w13's grid to finish before it reads h, so its first loads overlap w13's last
// wave and the launch gap), BM = 8 (rows of a segment a CTA: the
// mma's n). Requires K % 128 == 0, N % (16 * MT) == 0, x's row stride % 4 == 0 (the host checks).

#ifndef IS_W13
#define IS_W13 1
#endif
#ifndef G
#define G 128
#endif
#ifndef NW
#define NW 4
#endif
#ifndef MT
#define MT 2
#endif
#ifndef ZP
#define ZP 0
#endif
#ifndef WT_BF16
#define WT_BF16 0
#endif
#ifndef XPF
#define XPF 1                      // x (B) loaded with its unit's weights; 0: when its block is computed
#endif
#ifndef PDL
#define PDL 0
#endif

#define BM 8
#if IS_W13
#define TILES 2
#else
#define TILES MT
#endif
#define U (G > 128 ? G : 128)      // k per unit: one 128-k block, or one 256-k group
#define BPU (U / 128)              // blocks per unit
#define PPG (G / 16)               // 16-k planes per group
#define GPU_ (U / G)               // groups per unit

typedef unsigned int u32;
typedef unsigned short u16;

#define MAXT 4                     // tiles a warp at most (w2's MT)

// X: x (B) loaded with the unit's weights (XPF; the fused role's phase 2 has its own, XPF2), else
// when its block is computed (x then unused here, and the compiler drops it)
template <int T, bool X = XPF>
struct Unit {
    uint4 w[BPU][T][2];            // [block][tile][row half: gid, gid + 8] this lane's 16 bytes
    uint2 x[BPU][8];               // [block][plane] 4 bf16 of B for column gid (X only)
    u32 sz[GPU_][T][2];            // (scale, zero) words of each group, tile, row half
};

__device__ __forceinline__ uint4 ldw(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 ldg32(const u32* p) {
    u32 r;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ uint2 ldx(const u32* p) {
    uint2 r;
    asm volatile("ld.global.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// bf16x2 (128 + q_a, 128 + q_b): q_a = plane p's nibble of word a (low half), q_b of word b
template <int P>
__device__ __forceinline__ u32 pair(u32 a, u32 b) {
    u32 t, r;
    // bytes: 0 <- a.byte(P/2), 2 <- b.byte(P/2); bytes 1 and 3 are masked off below
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(a), "r"(b), "n"((P / 2) | ((4 + P / 2) << 8)));
    if (P & 1) t >>= 4;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(t), "n"(0x000F000F), "n"(0x43004300));
    return r;      // 0xEA: (a & b) | c
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ float h2f(u32 h) {
    float f;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "r"(h));
    return f;
}

// (s, z - 136 s) of a (scale, zero) word: bf16 (s, z), or with ZP fp16 (s, zp), z = (8 - zp) s
__device__ __forceinline__ void affine(u32 w, float& s, float& c) {
#if ZP
    s = h2f(w & 0xFFFFu);
    float zp = h2f(w >> 16);
    c = (8.0f - zp) * s - 136.0f * s;
#else
    s = bf_lo(w);
    c = bf_hi(w) - 136.0f * s;
#endif
}

__device__ __forceinline__ u16 f2bf(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

struct Ctx {
    const uint4* wp;     // the matrix's code words as 16-byte vectors
    const u32* sp;       // its (scale, zero) words
    const u32* xp;       // this lane's B column (x or h row), as bf16 pairs; null: zeros
    int NR;              // rows of the matrix (2N for w13)
    int rowb[MAXT];      // first row of each 16-row tile (the first T of them used)
    int gid, c;
};

__device__ __forceinline__ void load_x(uint2 (&x)[8], const Ctx& cx, int kb) {
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        if (cx.xp) x[p] = ldx(cx.xp + ((kb * 128 + p * 16 + 4 * cx.c) >> 1));
        else x[p] = make_uint2(0u, 0u);
    }
}

// the unit's x (B) only: what a dependent w2 reads after its wait (h is the grid before's output)
template <int T, bool X>
__device__ __forceinline__ void load_unit_x(Unit<T, X>& un, const Ctx& cx, int u) {
    if constexpr (X) {
#pragma unroll
        for (int b = 0; b < BPU; ++b) load_x(un.x[b], cx, u * BPU + b);
    }
}

template <bool WITH_X = true, int T, bool X>
__device__ __forceinline__ void load_unit(Unit<T, X>& un, const Ctx& cx, int u) {
#pragma unroll
    for (int b = 0; b < BPU; ++b) {
        const int kb = u * BPU + b;
#pragma unroll
        for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = (long long)kb * cx.NR + cx.rowb[t] + cx.gid + 8 * h;
                un.w[b][t][h] = ldw(cx.wp + row * 4 + cx.c);
            }
        }
        if constexpr (X && WITH_X) load_x(un.x[b], cx, kb);
    }
#pragma unroll
    for (int q = 0; q < GPU_; ++q) {
        const int grp = u * GPU_ + q;
#pragma unroll
        for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                un.sz[q][t][h] = ldg32(cx.sp + (long long)grp * cx.NR + cx.rowb[t] + cx.gid + 8 * h);
        }
    }
}

template <int P, int T, bool X>
__device__ __forceinline__ void plane(const Unit<T, X>& un, const uint2 (&x)[8], int b, float (&ga)[T][4],
                                      float (&xs)[4]) {
    const u32 b0 = x[P].x, b1 = x[P].y;
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const uint4 r0 = un.w[b][t][0], r1 = un.w[b][t][1];
        mma(ga[t], pair<P>(r0.x, r0.y), pair<P>(r1.x, r1.y), pair<P>(r0.z, r0.w), pair<P>(r1.z, r1.w), b0, b1);
    }
    mma(xs, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, b0, b1);     // A = ones: sum(x)
}

// group q of the unit ends: acc += s * ga + (z - 136 s) * sum(x); the group's sums restart
template <int T, bool X>
__device__ __forceinline__ void flush(const Unit<T, X>& un, int q, float (&acc)[T][4], float (&ga)[T][4],
                                      float (&xs)[4]) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float s, c;
            affine(un.sz[q][t][h], s, c);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                acc[t][2 * h + j] += s * ga[t][2 * h + j] + c * xs[j];
                ga[t][2 * h + j] = 0.0f;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) xs[j] = 0.0f;
}

template <int P, int T, bool X>
__device__ __forceinline__ void plane_and_flush(const Unit<T, X>& un, const uint2 (&x)[8], int b, float (&acc)[T][4],
                                                float (&ga)[T][4], float (&xs)[4]) {
    plane<P>(un, x, b, ga, xs);
    if ((b * 8 + P + 1) % PPG == 0) flush(un, (b * 8 + P) / PPG, acc, ga, xs);
}

template <int T, bool X>
__device__ __forceinline__ void compute_unit(const Unit<T, X>& un, float (&acc)[T][4], const Ctx& cx, int u) {
    float ga[T][4], xs[4];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) ga[t][j] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) xs[j] = 0.0f;
#pragma unroll
    for (int b = 0; b < BPU; ++b) {
        uint2 xb[8];
        if constexpr (X) {
#pragma unroll
            for (int p = 0; p < 8; ++p) xb[p] = un.x[b][p];
        } else {
            load_x(xb, cx, u * BPU + b);
        }
        const uint2 (&x)[8] = xb;
        plane_and_flush<0>(un, x, b, acc, ga, xs);
        plane_and_flush<1>(un, x, b, acc, ga, xs);
        plane_and_flush<2>(un, x, b, acc, ga, xs);
        plane_and_flush<3>(un, x, b, acc, ga, xs);
        plane_and_flush<4>(un, x, b, acc, ga, xs);
        plane_and_flush<5>(un, x, b, acc, ga, xs);
        plane_and_flush<6>(un, x, b, acc, ga, xs);
        plane_and_flush<7>(un, x, b, acc, ga, xs);
    }
}

// this CTA's segment (grid y = segment * nch + row chunk): its expert's slot bytes, first sorted row
// and row count (<= BM); null where the CTA has nothing to do (a padding id, no slot, an empty chunk)
__device__ __forceinline__ const unsigned char* seg_slot(const unsigned char* pool, int slot_bytes, const int* table,
                                                         int E, const int* seg_e, const int* seg_s,
                                                         const int* seg_end, int nch, int& start, int& cnt) {
    const int seg = blockIdx.y / nch, ch = blockIdx.y % nch;
    const int e = seg_e[seg];
    if (e < 0 || e >= E) return nullptr;
    const int slot = table[e];
    if (slot < 0) return nullptr;
    start = seg_s[seg] + ch * BM;
    const int end = seg_end[seg];
    if (start >= end) return nullptr;
    cnt = min(end - start, BM);
    return pool + (long long)slot * slot_bytes;
}

#if !FUSED
extern "C" __global__ void __launch_bounds__(NW * 32)
moe_mma(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ pool, int slot_bytes,
        const int* __restrict__ table, int E, const int* __restrict__ seg_e, const int* __restrict__ seg_s,
        const int* __restrict__ seg_end, const int* __restrict__ order, const void* __restrict__ wt,
        void* out, int stride_o, int w_off, int sz_off, int N, int K, int topk, int nch, int ups) {
#if PDL && IS_W13
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // no-op without a dependent
#endif
    int start, cnt;
    const unsigned char* base = seg_slot(pool, slot_bytes, table, E, seg_e, seg_s, seg_end, nch, start, cnt);
    if (!base) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Ctx cx;
    cx.gid = lane >> 2;
    cx.c = lane & 3;
    cx.wp = (const uint4*)(base + w_off);
    cx.sp = (const u32*)(base + sz_off);
    const int pos = start + cx.gid;                  // this lane's B column: row pos of the segment
#if IS_W13
    cx.NR = 2 * N;
    cx.rowb[0] = blockIdx.x * 16;
    cx.rowb[1] = N + blockIdx.x * 16;
    cx.xp = cx.gid < cnt ? (const u32*)(x + (long long)(order[pos] / topk) * stride_x) : nullptr;
#else
    cx.NR = N;
#pragma unroll
    for (int t = 0; t < TILES; ++t) cx.rowb[t] = blockIdx.x * 16 * MT + 16 * t;
    cx.xp = cx.gid < cnt ? (const u32*)(x + (long long)pos * stride_x) : nullptr;
#endif
    float acc[TILES][4];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[t][j] = 0.0f;

    // this CTA's units [lo, hi) (split pid z of grid z), taken by the warps in turn
    const int units = K / U;
    const int lo = blockIdx.z * ups, hi = min(units, lo + ups);
    // two units in turn: the next one's loads are issued before the current one is computed
    // (measured on the H200, BENCHMARKS.md twelfth session, all slower at every M: a ring of 3 or 4
    // units, loads 2-3 units ahead; launch bounds capping the registers at 4-6 CTAs a multiprocessor;
    // and (ce8df29) each warp feeding itself through 2-5 shared-memory stages by bulk copies on
    // mbarriers, 1 KB a copy: w13 at M = 1 26.2-40.6 us against 22.6, w2 14.9-17.3 against 13.0)
    int u = lo + warp;
    Unit<TILES> ua, ub;
#if PDL && !IS_W13
    // segments and acc's zeros come from the route kernel and the slot table from the host, all
    // before w13 began; h is w13's: the first two units' weights load, then the wait, then their h
    if (u < hi) load_unit<false>(ua, cx, u);
    if (u + NW < hi) load_unit<false>(ub, cx, u + NW);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (u < hi) load_unit_x(ua, cx, u);
    if (u + NW < hi) load_unit_x(ub, cx, u + NW);
    bool ahead = true;                               // ub is loaded already
#else
    if (u < hi) load_unit(ua, cx, u);
    const bool ahead = false;
#endif
    while (u < hi) {
        if (u + NW < hi && !ahead) load_unit(ub, cx, u + NW);
#if PDL && !IS_W13
        ahead = false;
#endif
        compute_unit(ua, acc, cx, u);
        u += NW;
        if (u >= hi) break;
        if (u + NW < hi) load_unit(ua, cx, u + NW);
        compute_unit(ub, acc, cx, u);
        u += NW;
    }

    // the warps' parts, added in warp order
    __shared__ float red[NW][TILES * 4][32];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][t * 4 + j][lane] = acc[t][j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = red[0][t * 4 + j][lane];
#pragma unroll
            for (int w = 1; w < NW; ++w) v += red[w][t * 4 + j][lane];
            acc[t][j] = v;
        }
    // C fragment: acc[t][2h + j] is (row rowb[t] + gid + 8h, column 2c + j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 2 * cx.c + j;
            if (col >= cnt) continue;
#if IS_W13
            const float g = acc[0][2 * h + j], up = acc[1][2 * h + j];
            const float hv = g / (1.0f + expf(-g)) * up;
            ((u16*)out)[(long long)(start + col) * stride_o + cx.rowb[0] + cx.gid + 8 * h] = f2bf(hv);
#else
            const int pr = order[start + col];
#if WT_BF16
            const float wv = bf_lo(((const u16*)wt)[pr]);
#else
            const float wv = ((const float*)wt)[pr];
#endif
            float* o = (float*)out + (long long)(pr / topk) * stride_o;
#pragma unroll
            for (int t = 0; t < TILES; ++t) atomicAdd(o + cx.rowb[t] + cx.gid + 8 * h, acc[t][2 * h + j] * wv);
#endif
        }
    }
}
#endif  // !FUSED

#if FUSED
// One launch for a layer's whole routed work (FUSED, the fused role): a CTA owns one k-unit of w2's
// K, i.e. U = max(128, G) consecutive intermediate columns f0 .. f0 + U - 1 of its segment's expert.
// Phase 1 computes those columns of h = silu(x W1^T) * (x W3^T) (U / 16 gate/up tile pairs, K = H
// split over the KS = NW / TP warps of a pair, their parts added in warp order) and writes them to h
// in global memory; phase 2 multiplies w2's unit f0 / U (all H rows of it, in steps of MT 16-row
// tiles taken by the warps in turn) by those h columns and adds the products, scaled by the routing
// weights, into acc by atomics. No CTA waits for another, so there is no second launch and no grid
// dependency: w2's bytes stream in the same wave as w13's (split-K of w2 by its units, as the w2
// role splits over grid z). Each warp loads its first w2 step's weights before the barrier that
// ends phase 1. Grid (F / U, segments * row chunks), NW warps (a multiple of TP); h as the w13 role
// writes it, so the w2 role's tests read the same h.
#define TP (U / 16)                // gate/up tile pairs a CTA
#define KS (NW / TP)               // warps on one tile pair (split-K inside the CTA)
#ifndef MINB
#define MINB 1
#endif
#ifndef XPF2
#define XPF2 0
#endif

// one phase-2 step: the unit's MT tiles of w2 times h, scaled by each pair's routing weight, into acc
__device__ __forceinline__ void fused_step(const Unit<MT, XPF2>& un, const Ctx& cx, int kb2, int start, int cnt,
                                           const int* __restrict__ order, const void* __restrict__ wt,
                                           float* acc_out, int stride_o, int topk) {
    float a2[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) a2[t][j] = 0.0f;
    compute_unit(un, a2, cx, kb2);
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 2 * cx.c + j;
            if (col >= cnt) continue;
            const int pr = order[start + col];
#if WT_BF16
            const float wv = bf_lo(((const u16*)wt)[pr]);
#else
            const float wv = ((const float*)wt)[pr];
#endif
            float* o = acc_out + (long long)(pr / topk) * stride_o;
#pragma unroll
            for (int t = 0; t < MT; ++t) atomicAdd(o + cx.rowb[t] + cx.gid + 8 * h2, a2[t][2 * h2 + j] * wv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NW * 32, MINB)
moe_fused(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ pool, int slot_bytes,
          const int* __restrict__ table, int E, const int* __restrict__ seg_e, const int* __restrict__ seg_s,
          const int* __restrict__ seg_end, const int* __restrict__ order, const void* __restrict__ wt,
          u16* h, int stride_h, float* acc_out, int stride_o, int w13_off, int sz13_off, int w2_off,
          int sz2_off, int N, int H, int topk, int nch) {
    static_assert(NW % TP == 0 && KS >= 1, "NW must be a multiple of the tile pairs a CTA");
    int start, cnt;
    const unsigned char* base = seg_slot(pool, slot_bytes, table, E, seg_e, seg_s, seg_end, nch, start, cnt);
    if (!base) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int f0 = blockIdx.x * U, tp = warp % TP;
    const int pos = start + (lane >> 2);

    // phase 1: gate/up rows f0 + 16 tp .. + 15 (and N + the same) over K = H, units kw, kw + KS, ...
    Ctx c1;
    c1.gid = lane >> 2;
    c1.c = lane & 3;
    c1.wp = (const uint4*)(base + w13_off);
    c1.sp = (const u32*)(base + sz13_off);
    c1.NR = 2 * N;
    c1.rowb[0] = f0 + 16 * tp;
    c1.rowb[1] = N + f0 + 16 * tp;
    c1.xp = c1.gid < cnt ? (const u32*)(x + (long long)(order[pos] / topk) * stride_x) : nullptr;
    float a1[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) a1[t][j] = 0.0f;
    {
        const int hi = H / U;
        int u = warp / TP;
        Unit<2> ua, ub;
        if (u < hi) load_unit(ua, c1, u);
        while (u < hi) {
            if (u + KS < hi) load_unit(ub, c1, u + KS);
            compute_unit(ua, a1, c1, u);
            u += KS;
            if (u >= hi) break;
            if (u + KS < hi) load_unit(ua, c1, u + KS);
            compute_unit(ub, a1, c1, u);
            u += KS;
        }
    }

    // phase 2's context: w2's unit kb2 = f0 / U, rows in steps of MT tiles; B = this segment's h
    Ctx c2 = c1;
    c2.wp = (const uint4*)(base + w2_off);
    c2.sp = (const u32*)(base + sz2_off);
    c2.NR = H;
    c2.xp = c2.gid < cnt ? (const u32*)(h + (long long)pos * stride_h) : nullptr;
    const int kb2 = blockIdx.x, steps = H / (16 * MT);
    int st = warp;
    Ctx ca = c2, cb = c2;
#pragma unroll
    for (int t = 0; t < MT; ++t) ca.rowb[t] = st * 16 * MT + 16 * t;
    Unit<MT, XPF2> ua, ub;
    if (st < steps) load_unit<false>(ua, ca, kb2);   // weights only: h is not written yet

    // phase 1's parts added in warp order (kw = 0, 1, ...), then h written by the first TP warps
    __shared__ float red[NW][8][32];
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][t * 4 + j][lane] = a1[t][j];
    __syncthreads();
    if (warp < TP) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float g = red[warp][2 * h2 + j][lane], up = red[warp][4 + 2 * h2 + j][lane];
#pragma unroll
                for (int k = 1; k < KS; ++k) {
                    g += red[warp + k * TP][2 * h2 + j][lane];
                    up += red[warp + k * TP][4 + 2 * h2 + j][lane];
                }
                const int col = 2 * c1.c + j;
                if (col >= cnt) continue;
                const float hv = g / (1.0f + expf(-g)) * up;
                h[(long long)(start + col) * stride_h + c1.rowb[0] + c1.gid + 8 * h2] = f2bf(hv);
            }
        }
    }
    __syncthreads();                                     // the CTA's h columns are written
    asm volatile("" ::: "memory");

    // phase 2: acc[row of pair, :] += wt(pair) * (w2[:, f0 .. f0 + U) @ h[pair, f0 .. f0 + U))
    if (st < steps) load_unit_x(ua, ca, kb2);
    while (st < steps) {
        const int nx = st + NW;
        if (nx < steps) {
#pragma unroll
            for (int t = 0; t < MT; ++t) cb.rowb[t] = nx * 16 * MT + 16 * t;
            load_unit(ub, cb, kb2);
        }
        fused_step(ua, ca, kb2, start, cnt, order, wt, acc_out, stride_o, topk);
        st = nx;
        if (st >= steps) break;
        const int nx2 = st + NW;
        if (nx2 < steps) {
#pragma unroll
            for (int t = 0; t < MT; ++t) ca.rowb[t] = nx2 * 16 * MT + 16 * t;
            load_unit(ua, ca, kb2);
        }
        fused_step(ub, cb, kb2, start, cnt, order, wt, acc_out, stride_o, topk);
        st = nx2;
    }
}
#endif  // FUSED
