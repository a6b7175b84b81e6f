"""Triton kernels for the executor (imported only on CUDA paths: this package imports triton).

`moe_triton` runs a whole MoE layer's routed experts from their pool slots, in four launches
back to back (five with a split-K gate/up; see `moe.py`): route (+ zeroing the fp32
accumulator), gate/up with SiLU, down with the routing weights (split-K, fp32 atomics), and the
cast to the output dtype. `attention` holds the lean engine's decode attention (rotation, cache
write and GQA over the cache in one launch), `steps` its one-launch router (matmul and top-k, or
top-k alone) and residual sum, `norm` the one-launch RMSNorm and residual add with RMSNorm, `gemv`
the decode projections.
"""

from cmoe.executor.kernels_triton.moe import CONFIGS, KernelConfig, Workspace, moe_triton, pick_config

__all__ = ["CONFIGS", "KernelConfig", "Workspace", "moe_triton", "pick_config"]
