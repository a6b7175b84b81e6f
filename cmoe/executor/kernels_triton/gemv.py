"""A decode step's bf16 projections (q/k/v and o_proj of the lean attention) for a few rows.

`linear(x, w, b)`: y = x @ w^T (+ b) for x [M <= 16, K], one launch over programs of BN output
rows each, every program streaming its BN x K slice of w once through a pipelined k loop and
multiplying it on the tensor cores with x padded to 16 rows (fp32 accumulation, one rounding to
the output dtype; the bias added in fp32 before it).

Why: at one row cuBLAS ran the o projection (4096 x 4096) as a split-K GEMM plus a reduction, two
launches, 10.7 + 1.8 us, and the q/k/v one (6144 x 4096) at 15.7 us, where their bytes take 7.9
and 11.8 us at the H200's 4.26 TB/s (BENCHMARKS.md, fourteenth session). Measured on the H200
(fifteenth session), with the configuration of `config`: 15.6 against cuBLAS's 16.4 us for q/k/v
and 12.6 against 12.7 for o at one row (`benchmarks/gemv_h200.py`), and `upper` 3.87-3.88 ms a
token at batch 1 against 3.93 with cuBLAS, 7.01-7.03 against 7.07-7.09 at batch 4, 8.33-8.39
against 8.39 at batch 8, in one process. So it is the default on CUDA; CMOE_GEMV=0 keeps cuBLAS.
The outputs may differ from cuBLAS's in the last bit, as any change of GEMM shape can.

`gemv(..., norm=(weight, eps))` folds an RMSNorm of its one row into the x tiles: the row's sum
of squares first (one register pass over the row), then each tile normed as `norm._rms_row` norms
it (the same roundings as transformers; only the sum's order may differ), so the q/k/v GEMV can
take the layer's input norm and spare its launch. Measured on the H200 (2026-12-03, Mixtral's
q/k/v, 6144 x 4096, one row): the first version took 34.5 us against 15.5 for the GEMV alone and
18.0 for the norm's launch then the GEMV, and made `upper` 14% slower. The register pass cost at
most 1.2 us of that; the norm's weight, loaded as a [BK] vector, the rest (2 bytes a thread, too
narrow for cp.async, so each k step waited on a plain load). A helper session's variants (the
same day) loaded it as a tile like x's: 16.7-17.5 us at 64 output rows a program. The one kept here
also keeps transformers' roundings and the pass before the loop; it matched the two launches bit
for bit and took 20.2 us at 32 rows a program. Its time at Mixtral's q/k/v configuration was not
taken on its own. The fastest variant summed the squares inside the k loop and applied 1 / rms in
the epilogue. It was twice as slow below 64 rows a program, and its roundings were not
transformers': with it the lean executor's qwen2_moe logits left the 1e-2 the GPU test allows (one
H200 run), so it was not kept. Opt-in (CMOE_QKV_NORM=1, `attention.FastDecode.normed`): at best
~0.5 us a layer saved.

CMOE_PDL=1 (`pdl_enabled`, opt-in likewise): the GEMV is launched with Hopper's programmatic
dependent launch, so it may start while the kernel ahead of it runs; it loads its first weight
tile (which no kernel writes), waits in `griddepcontrol.wait` until that kernel has finished and
its writes are visible, and only then reads x and writes y. The norm and attention kernels
signal their dependents at their start. The w2 expert kernel gained ~1.9 us from the same trick
(BENCHMARKS.md, thirteenth session).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16


def enabled() -> bool:
    return os.environ.get("CMOE_GEMV", "1") != "0"


@triton.jit
def _gemv(x_ptr, sx, w_ptr, b_ptr, y_ptr, sy, nw_ptr, eps, M, N, K, HAS_B: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.arange(0, 16)
    rm = r < M
    if PDL:         # launched before the kernel ahead ends: its first weights, then wait for x
        k = tl.arange(0, BK)
        w0 = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if NORM:        # one row's RMSNorm (weight at nw_ptr), as `norm._rms_row` computes it, on each x tile
        kk = tl.arange(0, KP)
        x0 = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x0 * x0, axis=0) / K + eps)
    acc = tl.zeros([BN, 16], tl.float32)
    k_first = 0
    if PDL:
        acc = tl.dot(w0, _x_tile(x_ptr, sx, nw_ptr, rstd, r, rm, tl.arange(0, BK), K, NORM), acc)
        k_first = BK
    for k0 in tl.range(k_first, K, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(w, _x_tile(x_ptr, sx, nw_ptr, rstd, r, rm, k, K, NORM), acc)
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + r[None, :] * sy + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=nm[:, None] & rm[None, :])


@triton.jit
def _x_tile(x_ptr, sx, nw_ptr, rstd, r, rm, k, K, NORM: tl.constexpr):
    """x's columns k as [BK, 16] (rows past M zero); with NORM, normed as `norm._rms_row` norms:
    (x * rstd) rounded to x's dtype, times the norm's weight, rounded again."""
    km = k < K
    xt = tl.load(x_ptr + r[None, :] * sx + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)
    if NORM:
        dt = x_ptr.dtype.element_ty
        h = (xt.to(tl.float32) * rstd).to(dt)
        # the weight as a tile like x's, not a [BK] vector: 2 bytes a thread is too narrow for
        # cp.async, and each k step waited on it (module docstring)
        nw = tl.load(nw_ptr + 0 * r[None, :] + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)
        xt = (nw.to(tl.float32) * h.to(tl.float32)).to(dt)
    return xt


def fits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """What `_gemv` takes: a CUDA bf16 (or fp16) x of at most MAX_ROWS rows with a unit inner
    stride, the weight [N, K] of the same dtype and contiguous, a bias (if any) of N contiguous."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and w.is_contiguous() and w.dim() == 2
            and w.shape[1] == x.shape[1]
            and (b is None or (b.is_contiguous() and b.shape == (w.shape[0],) and b.dtype == x.dtype)))


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, bn: int = 16, bk: int = 256,
         stages: int = 4, norm: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b) -> [M, N] in x's dtype, by `_gemv` (see `fits`). With `norm`
    (an RMSNorm's weight [K] and epsilon; `fits_norm`), the product of x's norm: one row only."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (w, 0.0)
    if norm is not None and M != 1:
        raise ValueError("gemv: the norm is folded in for one row only")
    pdl = pdl_enabled(x.device)
    _gemv[(triton.cdiv(N, bn),)](x, x.stride(0), w, b if b is not None else w, y, y.stride(0), nw, float(eps), M, N,
                                 K, HAS_B=b is not None, BN=bn, BK=bk, STAGES=stages, NORM=norm is not None,
                                 KP=triton.next_power_of_2(K), PDL=pdl, launch_pdl=pdl, num_warps=4)
    return y


def pdl_enabled(device) -> bool:
    """CMOE_PDL=1 where the CUDA expert kernels' dependent launch works (`kernels_cuda.moe.pdl_ok`:
    sm_90+ and cuLaunchKernelEx, checked once a device). The GEMV is then launched to start while
    the kernel ahead of it ends, loads its first weights and waits (`griddepcontrol.wait`) before
    it reads x; the kernels that precede it in a layer (`norm._rms_kernel`,
    `attention._rope_attend`) signal it early (their TRIGGER). Off by default: on the H200 `upper`
    moved within its spread with it (sixteenth session); never under Triton's interpreter."""
    if os.environ.get("CMOE_PDL", "0") != "1" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    device = torch.device(device)
    from cmoe.executor.kernels_cuda.moe import pdl_ok          # the check the CUDA expert kernels use
    return device.type == "cuda" and pdl_ok(device.index or 0)


def fits_norm(x: torch.Tensor, w: torch.Tensor, b, weight: torch.Tensor) -> bool:
    """What `gemv` takes with a norm folded in: `fits`, one row, at most 8192 wide (the row's sum of
    squares is one register pass), and the norm's weight contiguous, [K], of x's dtype (so the
    normed row keeps x's dtype, as `norm.rms_norm` gives it)."""
    return (fits(x, w, b) and x.shape[0] == 1 and x.shape[1] <= 8192 and weight.is_contiguous()
            and weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.device == x.device)


def norm_enabled() -> bool:
    """CMOE_QKV_NORM=1: the lean layer folds the input norm into the q/k/v GEMV at one row (off by
    default: at best ~0.5 us a layer on the H200; module docstring)."""
    return os.environ.get("CMOE_QKV_NORM", "0") == "1"


def config(n: int) -> tuple[int, int, int]:
    """(BN, BK, stages) by the output width: the fastest of five on the H200 for Mixtral's q/k/v
    (6144 rows: 64, 128, 4; 15.6 us at M = 1 against cuBLAS's 16.4) and o (4096: 32, 256, 3; 12.6
    against 12.7), fifteenth session's `benchmarks/gemv_h200.py`."""
    return (64, 128, 4) if n >= 6144 else (32, 256, 3)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by `gemv` where it is enabled (unless CMOE_GEMV=0) and takes the shapes."""
    if enabled() and fits(x, w, b):
        return gemv(x, w, b, *config(w.shape[0]))
    return F.linear(x, w, b)
