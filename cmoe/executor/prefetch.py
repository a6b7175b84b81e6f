"""Weights pulled into the GPU's L2 while the step runs kernels that leave HBM idle.

At batch 1 a decode layer alternates kernels that stream weights (q/k/v, o, the experts) with
kernels that wait on latency (the norms, the attention over a short cache, the router): on the
H200 about 17 us of a layer's ~120 us read almost nothing from HBM (BENCHMARKS.md, the fourteenth
session's kernel profile). `prefetch(w, frac)` launches a kernel whose programs hand the copy
engine one `cp.async.bulk.prefetch.L2` per weight row (its first `frac` of bytes) and exit; the
lines arrive while the latency-bound kernels run, and the projection that follows reads them from
L2. The prefetch changes no value: it is a cache hint, so the results stay bit for bit the same.

`Prefetcher.branch` launches it on a side stream forked from the current one and joins it back
later, so under a CUDA-graph capture it is a parallel branch: neither the kernel it runs beside
nor the one it feeds waits for it (the kernel only issues the requests and ends in ~2 us).

The H200's L2 holds 50 MB (60 on the die, 50 enabled); a layer's o projection (32 MiB for
Mixtral) fits whole, its q/k/v (48 MiB) only in part, so `frac` takes the first part of each row:
the part a k-ordered projection reads first. CMOE_L2_PREFETCH=1 turns it on, CMOE_L2_O and CMOE_L2_QKV say how much (`plan`); the kernel is in `kernels_triton.prefetch`.
"""

from __future__ import annotations

import os

import torch

from cmoe.core.errors import CmoeError


def plan(env=None) -> dict:
    """{what: fraction of each row} from the environment: CMOE_L2_PREFETCH=1 turns the prefetch on
    (off by default), CMOE_L2_O and CMOE_L2_QKV set the fractions of o's and of q/k/v's weights
    (1 and 0.25 unless set; 0 leaves that weight out). A fraction outside [0, 1] raises CmoeError."""
    env = os.environ if env is None else env
    if env.get("CMOE_L2_PREFETCH", "0") != "1":
        return {}
    out = {}
    for name, var, default in (("o", "CMOE_L2_O", "1"), ("qkv", "CMOE_L2_QKV", "0.25")):
        text = env.get(var, default)
        try:
            f = float(text)
        except ValueError:
            raise CmoeError(f"{var}={text!r} is not a number: give a fraction from 0 to 1") from None
        if not 0.0 <= f <= 1.0:
            raise CmoeError(f"{var}={text} is outside [0, 1]: give a fraction from 0 to 1")
        if f > 0:
            out[name] = f
    return out


def row_segment(w: torch.Tensor, frac: float) -> tuple[int, int, int]:
    """(rows, row stride in bytes, bytes to fetch per row) for a row-major 2-D weight: the first
    `frac` of each row, rounded up to whole 16-byte units (the copy engine's granule), at least one
    unit; (0, 0, 0) when the rows are not 16-byte aligned (nothing is fetched then)."""
    if w.dim() != 2 or w.stride(1) != 1:
        return 0, 0, 0
    es = w.element_size()
    stride, row = w.stride(0) * es, w.shape[1] * es
    if stride % 16 or w.data_ptr() % 16 or row % 16:
        return 0, 0, 0
    seg = min(row, max(16, -(-int(row * frac) // 16) * 16))
    return w.shape[0], stride, seg


def prefetch(w: torch.Tensor, frac: float) -> None:
    """Ask L2 for the first `frac` of each row of w (a CUDA tensor), on the current stream."""
    rows, stride, seg = row_segment(w, frac)
    if rows:
        from cmoe.executor.kernels_triton.prefetch import launch
        launch(w, rows, stride, seg)


class Prefetcher:
    """Forks prefetches off the current stream and joins them back (`branch`, `join`), only while
    a CUDA graph is being captured: eagerly the fork would cost the host more than it saves. Made
    on the device it serves: it makes its side stream and loads the kernel there, outside any
    capture."""

    def __init__(self, spec: dict, device: torch.device):
        self.spec = spec
        self.side = torch.cuda.Stream(device=device)
        prefetch(torch.zeros(1, 64, device=device), 1.0)       # compiled and loaded before a capture
        self.open = False

    def branch(self, name: str, w: torch.Tensor) -> None:
        frac = self.spec.get(name)
        if not frac or not torch.cuda.is_current_stream_capturing():
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            prefetch(w, frac)
        self.open = True

    def join(self) -> None:
        if self.open:
            torch.cuda.current_stream().wait_stream(self.side)
            self.open = False
