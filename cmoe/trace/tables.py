"""Routes as a Parquet table (one row per token and MoE layer) for polars users. CPU side only:
the GPU machine reads the safetensors arrays instead."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:                      # bundle imports this module (lazily): no cycle at run time
    from cmoe.trace.bundle import Trace


def routes_frame(t: Trace):
    import polars as pl
    T, M, K = t.experts.shape
    rep = lambda a: np.repeat(a, M)  # noqa: E731
    return pl.DataFrame({
        "token": rep(np.arange(T, dtype=np.int32)), "request": rep(t.request), "step": rep(t.step),
        "phase": rep(t.phase), "layer": np.tile(np.asarray(t.spec.moe_layers, dtype=np.int16), T),
        "experts": t.experts.reshape(T * M, K), "weights": t.weights.reshape(T * M, K),
        "pred_experts": t.pred_experts.reshape(T * M, K)})


def write_routes_parquet(t: Trace, path: Path) -> None:
    routes_frame(t).write_parquet(path)
