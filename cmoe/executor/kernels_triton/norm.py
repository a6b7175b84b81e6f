"""RMSNorm in one launch, the same arithmetic as transformers' RMSNorm modules of every supported
family: x to fp32, x * rsqrt(mean(x^2) + eps), back to x's dtype, times the weight (rounded to
the weight's and x's common dtype). Only the order of the fp32 sum of squares differs.

Why: under a CUDA graph the host no longer pays per launch but the GPU still does (~2-3 us a
node on the H200), and transformers' RMSNorm is seven element-wise launches; a decoder layer has
two or more of them. Measured in BENCHMARKS.md (lean engine, attention per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cmoe.executor.kernels_triton.gemv import pdl_enabled

NORM_CLASSES = ("MixtralRMSNorm", "OlmoeRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "DeepseekV2RMSNorm",
                "DeepseekV3RMSNorm")


@triton.jit
def _rms_row(x, dt, w_ptr, y_ptr, row, offs, keep, n, eps):
    """Row `row` of the norm into y: x (fp32, 0 past n) times rsqrt(mean(x^2) + eps), back to the
    activations' dtype dt as transformers does, times the weight."""
    var = tl.sum(x * x, axis=0) / n
    h = (x * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + offs, mask=keep, other=0.0)
    tl.store(y_ptr + row * n + offs, (w.to(tl.float32) * h.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _rms_kernel(x_ptr, stride_x, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:                 # the GEMV after it may start now and wait (`gemv.pdl_enabled`)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=keep, other=0.0).to(tl.float32)
    _rms_row(x, x_ptr.dtype.element_ty, w_ptr, y_ptr, row, offs, keep, n, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, n) if x.is_contiguous() else x.contiguous().reshape(-1, n)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    _rms_kernel[(rows.shape[0],)](rows, rows.stride(0), weight, y, n, eps, BLOCK=triton.next_power_of_2(n),
                                  TRIGGER=pdl_enabled(x.device), num_warps=4 if n <= 4096 else 8)
    return y.view(*x.shape[:-1], n)


@triton.jit
def _add_rms_kernel(r_ptr, a_ptr, w_ptr, mid_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    dt = mid_ptr.dtype.element_ty
    r = tl.load(r_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
    mid = (r + a).to(dt, fp_downcast_rounding="rtne")               # torch's add: in fp32, rounded once
    tl.store(mid_ptr + row * n + offs, mid, mask=keep)
    _rms_row(mid.to(tl.float32), dt, w_ptr, y_ptr, row, offs, keep, n, eps)


def add_rms_norm(residual: torch.Tensor, a: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """mid = residual + a (as torch adds), then `norm` (an RMSNorm module) of mid: (mid, norm(mid))
    in one launch, a decoder layer's residual add and post-attention norm (`cmoe.executor.
    lean_program`). Two tensors of one shape and dtype."""
    if residual.shape != a.shape or residual.dtype != a.dtype:
        raise ValueError("add_rms_norm takes two tensors of one shape and dtype")
    residual, a = residual.contiguous(), a.contiguous()
    n = residual.shape[-1]
    mid = torch.empty_like(residual)
    y = torch.empty(residual.shape, dtype=torch.promote_types(norm.weight.dtype, residual.dtype), device=residual.device)
    _add_rms_kernel[(residual.numel() // n,)](residual, a, norm.weight, mid, y, n, norm.variance_epsilon,
                                              BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return mid, y


def fuse_norms(model) -> list:
    """Point every RMSNorm module of `model` at the one-launch kernel. Returns what `unfuse` needs
    to put them back (the model may be shared with the reference engine)."""
    done = []
    for mod in model.modules():
        if type(mod).__name__ in NORM_CLASSES and hasattr(mod, "variance_epsilon"):
            def fwd(hidden_states, _m=mod):
                return rms_norm(hidden_states, _m.weight, _m.variance_epsilon)
            mod.forward = fwd
            done.append(mod)
    return done


def unfuse(mods: list) -> None:
    for mod in mods:
        if "forward" in mod.__dict__:
            del mod.forward
