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

struct Unit {
    uint4 w[BPU][TILES][2];        // [block][tile][row half: gid, gid + 8] this lane's 16 bytes
#if XPF
    uint2 x[BPU][8];               // [block][plane] 4 bf16 of B for column gid
#endif
    u32 sz[GPU_][TILES][2];        // (scale, zero) words of each group, tile, row half
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
    int rowb[TILES];     // first row of each 16-row tile
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
__device__ __forceinline__ void load_unit_x(Unit& un, const Ctx& cx, int u) {
#if XPF
#pragma unroll
    for (int b = 0; b < BPU; ++b) load_x(un.x[b], cx, u * BPU + b);
#endif
}

template <bool WITH_X = true>
__device__ __forceinline__ void load_unit(Unit& un, const Ctx& cx, int u) {
#pragma unroll
    for (int b = 0; b < BPU; ++b) {
        const int kb = u * BPU + b;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = (long long)kb * cx.NR + cx.rowb[t] + cx.gid + 8 * h;
                un.w[b][t][h] = ldw(cx.wp + row * 4 + cx.c);
            }
        }
#if XPF
        if (WITH_X) load_x(un.x[b], cx, kb);
#endif
    }
#pragma unroll
    for (int q = 0; q < GPU_; ++q) {
        const int grp = u * GPU_ + q;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                un.sz[q][t][h] = ldg32(cx.sp + (long long)grp * cx.NR + cx.rowb[t] + cx.gid + 8 * h);
        }
    }
}

template <int P>
__device__ __forceinline__ void plane(const Unit& un, const uint2 (&x)[8], int b, float (&ga)[TILES][4],
                                      float (&xs)[4]) {
    const u32 b0 = x[P].x, b1 = x[P].y;
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
        const uint4 r0 = un.w[b][t][0], r1 = un.w[b][t][1];
        mma(ga[t], pair<P>(r0.x, r0.y), pair<P>(r1.x, r1.y), pair<P>(r0.z, r0.w), pair<P>(r1.z, r1.w), b0, b1);
    }
    mma(xs, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, b0, b1);     // A = ones: sum(x)
}

// group q of the unit ends: acc += s * ga + (z - 136 s) * sum(x); the group's sums restart
__device__ __forceinline__ void flush(const Unit& un, int q, float (&acc)[TILES][4], float (&ga)[TILES][4],
                                      float (&xs)[4]) {
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
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

template <int P>
__device__ __forceinline__ void plane_and_flush(const Unit& un, const uint2 (&x)[8], int b, float (&acc)[TILES][4],
                                                float (&ga)[TILES][4], float (&xs)[4]) {
    plane<P>(un, x, b, ga, xs);
    if ((b * 8 + P + 1) % PPG == 0) flush(un, (b * 8 + P) / PPG, acc, ga, xs);
}

__device__ __forceinline__ void compute_unit(const Unit& un, float (&acc)[TILES][4], const Ctx& cx, int u) {
    float ga[TILES][4], xs[4];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) ga[t][j] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) xs[j] = 0.0f;
#pragma unroll
    for (int b = 0; b < BPU; ++b) {
#if XPF
        const uint2 (&x)[8] = un.x[b];
#else
        uint2 x[8];
        load_x(x, cx, u * BPU + b);
#endif
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

extern "C" __global__ void __launch_bounds__(NW * 32)
moe_mma(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ pool, int slot_bytes,
        const int* __restrict__ table, int E, const int* __restrict__ seg_e, const int* __restrict__ seg_s,
        const int* __restrict__ seg_end, const int* __restrict__ order, const void* __restrict__ wt,
        void* out, int stride_o, int w_off, int sz_off, int N, int K, int topk, int nch, int ups) {
#if PDL && IS_W13
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // no-op without a dependent
#endif
    const int seg = blockIdx.y / nch, ch = blockIdx.y % nch;
    const int e = seg_e[seg];
    if (e < 0 || e >= E) return;
    const int slot = table[e];
    if (slot < 0) return;
    const int start = seg_s[seg] + ch * BM, end = seg_end[seg];
    if (start >= end) return;
    const int cnt = min(end - start, BM);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Ctx cx;
    cx.gid = lane >> 2;
    cx.c = lane & 3;
    const unsigned char* base = pool + (long long)slot * slot_bytes;
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
    Unit ua, ub;
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
