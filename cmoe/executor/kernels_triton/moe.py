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
sum(x) read instead from a table of each row's group sums made before the launch (gsum13 /
gsum2, 1e587ca: a third of w13's HMMAs gone) was slower on the H200 at every M (one expert at
M = 1: 50.8 us against 45.0; benchmarks/results/lean-h200-9/call1-variants.json) and was removed.
Scales are prefetched one k-unit ahead (their loads would otherwise stall every unit); weights and
x tiles stream through Triton's cp.async pipeline. Accumulation is fp32 throughout. Which of these
is fastest depends on M (CONFIGS); with 32 weight rows per warp Triton keeps the unpacked operand
in registers and uses mma.sync, which beat its wgmma code here (that waits after every wgmma).

Not on CUDA cores: a kernel with this grid and epilogue that made each nibble an fp32 128 + q by
bit moves and spent an fma per row (no padding of rows to 16; ~30 SASS instructions per word) was
no faster on the H200 at M = 1 (w13 29.3-59.4 us against 31.3-31.9, w2 14.6-20.1 against
13.6-13.7, a layer of 2 experts 78.3-100.7 against 76.7-77.5) and far slower from M = 2 on
(BENCHMARKS.md, eleventh session; commits 6518921 and 3801b7b hold it).

The CUDA C++ kernel (`cmoe.executor.kernels_cuda`, twelfth session) takes the place of `_expert_mm`
for either matrix when a KernelConfig names its warps (cu13, cu2) and the layout has no k tail: same
slots, segments, h and acc, so route, reduction and copy stay here. CONFIGS use it up to 16 rows.

Files: this one holds the host side (KernelConfig, CONFIGS, Workspace, the launches, `moe_triton`);
`moe_device.py` the kernels (`_route_kernel`, `_expert_mm` with its parts as inlined
@triton.jit helpers, `_gate_up_kernel`); `moe_dequant.py` the device helpers that unpack and
dequantize the int4 planes (the inline PTX), load the (scale, zero) pairs and do a plane's step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from cmoe.executor.kernels_triton.moe_device import _expert_mm, _gate_up_kernel, _route_kernel


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
    unroll13: int = 1    # the w13 kernel's k-unit loop unrolled this many times (more loads in flight)
    unroll2: int = 1     # the same for w2
    stg13: int = 0       # the w13 k-unit loop's own num_stages (0: the launch's; measured no faster)
    stg2: int = 0        # the same for w2
    cu13: int = 0        # w13 by the CUDA kernel (kernels_cuda) on this many warps a CTA; 0: Triton
    cu2: int = 0         # the same for w2
    cut2: int = 2        # the CUDA w2's 16-row tiles a warp
    cus2: int = 4        # the CUDA w2's split-K over CTAs
    cux13: bool = False  # the CUDA w13 loads x with its unit's weights (else when its block is computed)
    cux2: bool = True    # the same for the CUDA w2
    cupdl: bool = False  # the CUDA w2 a programmatic dependent of the CUDA w13 (sm_90+): its first loads early


# by batch rows M (the smallest bucket >= M): the configurations benchmarks/expert_kernel_h200.py
# chose on the H200 (2026-12-01; each checked against the fp32 reference on a Mixtral layer and
# expert, then the fastest layer among the correct candidates). 32 rows per warp keeps the
# unpacked operand in registers (mma.sync); 4 warps and BN >= 64 make Triton use wgmma.
# M <= 16: both matrices on the CUDA kernel (kernels_cuda; benchmarks/kernel_variants_h200.py, twelfth
# session: one expert at M = 1 in ~38 us against 45-47, a layer of 8 experts at top-2 faster at
# M = 1-8). M = 1-4: w13 on 4 warps with x loaded with its unit, w2 on 4 warps of 4 tiles, split 4
# (the fastest layer at M = 1, 2 and 4 in call 6, within 1% of the fastest in call 3); M = 8: one
# warp a w13 CTA and w2 on 2 warps (the layer's 8 experts fill the machine; fastest in call 6,
# 1.6% off call 3's fastest). Thirteenth session (results/lean-h200-13/call3-kernel_variants.json):
# w2 a programmatic dependent of w13 (cupdl) made the fastest layer at every M from 1 to 16 (one
# expert at M = 1 35.6 us against 38.5, the layer at M = 16 235.2 against Triton's 250.8), so
# M = 16 moves to the CUDA kernel too.
_TRITON_1 = KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False)
_CUDA_F = dict(cu13=4, cux13=True, cu2=4, cut2=4, cus2=4, cupdl=True)
_CUDA_D = dict(cu13=1, cu2=2, cut2=2, cus2=4, cupdl=True)
CONFIGS: dict[int, KernelConfig] = {
    1: replace(_TRITON_1, **_CUDA_F),
    2: KernelConfig(16, 64, 2, 3, 128, 16, 4, 3, deq=False, deq2=True, **_CUDA_F),
    4: replace(_TRITON_1, **_CUDA_F),
    8: replace(_TRITON_1, **_CUDA_D),
    16: replace(_TRITON_1, **_CUDA_D),
    32: KernelConfig(32, 64, 2, 3, 128, 16, 4, 3, deq=True, deq2=True),
    64: KernelConfig(64, 64, 4, 3, 128, 8, 4, 3, deq=False, deq2=True),
}


def pick_config(M: int, triton_only: bool = False) -> KernelConfig:
    """CONFIGS' entry for M rows (the smallest bucket >= M); triton_only: with the CUDA kernel off
    (cu13 = cu2 = 0), the base of a sweep of the Triton kernel's own settings."""
    cfg = CONFIGS[max(CONFIGS)]
    for b in sorted(CONFIGS):
        if M <= b:
            cfg = CONFIGS[b]
            break
    return replace(cfg, cu13=0, cu2=0) if triton_only else cfg


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


# pairs above this are routed by torch ops (`moe_route.route_into`), not `_route_kernel`: that kernel holds
# all P pairs in one program (a [P, 64] compare per step), and its compile grows with P; on the
# H200 the calibration's 2048-token prefill (4,096 pairs) spent ~150 s in Triton's compiler
ROUTE_KERNEL_MAX_PAIRS = 512


def launch_route(ws: Workspace, topk_ids: torch.Tensor) -> None:
    P = ws.P
    if P > ROUTE_KERNEL_MAX_PAIRS:
        from cmoe.executor.moe_route import route_into
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


def _cuda(layout, x, pool, tiles: int):
    """`kernels_cuda.moe` where a launch that names CUDA warps (cu13, cu2) may try the CUDA kernel:
    NVRTC through torch on this device and tensors it reads (`fits`); else None (Triton runs)."""
    from cmoe.executor.kernels_cuda import moe as C
    return C if C.available(x.device.index or 0) and C.fits(layout, x, pool, tiles) else None


def launch_w13(ws: Workspace, x, slot_table, pool, layout, topk: int, cfg: KernelConfig, warmup=False):
    """gate/up with SiLU into ws.h; with split13 > 1 two launches (the split w13, its reduction).
    Returns the w13 launch's kernel (with warmup: both are compiled)."""
    if cfg.cu13 and (C := _cuda(layout, x, pool, 1)):
        k = C.launch_w13(ws, x, slot_table, pool, layout, topk, cfg.cu13, cfg.cux13, warmup, cfg.cupdl)
        if k is not None:                    # None: it did not compile (warned), Triton runs below
            return k
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
              num_stages=cfg.stages13, UNR=cfg.unroll13, STG=cfg.stg13 or None)
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
    if cfg.cu2 and (C := _cuda(layout, ws.h, pool, cfg.cut2)):
        k = C.launch_w2(ws, topk_weights, slot_table, pool, layout, topk, M, cfg.cu2, cfg.cut2,
                        k_split(layout.ffn, layout.group, cfg.cus2), cfg.cux2, warmup, cfg.cupdl)
        if k is not None:
            return k
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
              num_stages=cfg.stages2, UNR=cfg.unroll2, STG=cfg.stg2 or None)
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
