"""Time and ordering on the device: a clock that marks points on a stream, and the GPU slot pool
with its copy stream.

On CUDA a mark is a timing event recorded on a stream (read back once the pass is over, so
measuring never stalls the pipeline), and ordering uses one persistent event pair per slot:
`ready` (recorded on the copy stream after a load) and `read` (recorded on the compute stream
after the last kernel that read the slot). A load waits for `read` before overwriting; a kernel
waits for `ready` before reading. On the CPU everything is synchronous: marks are
`perf_counter` readings and waits are no-ops, so the same engine code runs in the tests.
Host-side spans (CPU experts, round trips) are placed on the device clock through the offset
taken when the clock started, right after a full synchronisation.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from cmoe.executor.kernels import ExpertViews
from cmoe.executor.layout import ExpertLayout
from cmoe.policy.pool import PoolLayout


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            torch.cuda.synchronize(device)
        self.host0 = time.perf_counter()

    def host(self) -> float:
        """Now, on the host, in microseconds since the clock started."""
        return (time.perf_counter() - self.host0) * 1e6

    def mark(self, stream=None):
        if not self.cuda:
            return self.host()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def done(self, h) -> bool:
        return isinstance(h, float) or h.query()

    def us(self, h) -> float:
        return h if isinstance(h, float) else self.ref.elapsed_time(h) * 1e3


class DevicePool:
    """One pre-allocated buffer carved into equal slots per block, plus the copy stream."""

    def __init__(self, layout: PoolLayout, expert: ExpertLayout, device: torch.device, views: bool = True):
        self.layout, self.device = layout, device
        self.cuda = device.type == "cuda"
        for m, sb in enumerate(layout.slot_bytes):
            assert sb >= expert.nbytes, f"slot of block {m} ({sb} B) is smaller than an expert ({expert.nbytes} B)"
        self.buf = torch.empty(layout.used_bytes, dtype=torch.uint8, device=device)
        self.views: list[list[ExpertViews]] = []
        self.raw: list[list[torch.Tensor]] = []
        self.blocks: list[torch.Tensor] = []                      # [slots, slot bytes] per block
        off = 0
        for sb, n in zip(layout.slot_bytes, layout.slots):
            raw = [self.buf[off + s * sb: off + s * sb + expert.nbytes] for s in range(n)]
            self.raw.append(raw)
            self.blocks.append(self.buf[off: off + sb * n].view(n, sb))
            self.views.append([ExpertViews(expert, r, device.type) for r in raw] if views else [])
            off += sb * n
        self.expert = [[-1] * n for n in layout.slots]           # what physically sits in each slot
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = [[torch.cuda.Event() if self.cuda else None for _ in range(n)] for n in layout.slots]
        self.read = [[torch.cuda.Event() if self.cuda else None for _ in range(n)] for n in layout.slots]
        self.pending = [[False] * n for n in layout.slots]         # a load not yet waited for by compute
        self.was_read = [[False] * n for n in layout.slots]

    def load(self, m: int, slot: int, e: int, src: torch.Tensor, clock: Clock):
        """Copy expert e's host bytes into a slot on the copy stream. Returns (start, end) marks."""
        dst = self.raw[m][slot]
        ctx = torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext()
        with ctx:
            if self.cuda and self.was_read[m][slot]:
                self.copy_stream.wait_event(self.read[m][slot])
            t0 = clock.mark(self.copy_stream)
            dst.copy_(src[: dst.numel()], non_blocking=True)
            t1 = clock.mark(self.copy_stream)
            if self.cuda:
                self.ready[m][slot] = t1              # the end mark is the event a reader waits for
        self.expert[m][slot] = e
        self.pending[m][slot] = True
        return t0, t1

    def before_read(self, m: int, slot: int) -> None:
        if self.pending[m][slot]:
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[m][slot])
            self.pending[m][slot] = False

    def after_read(self, m: int, slot: int) -> None:
        if self.cuda:
            self.read[m][slot].record(torch.cuda.current_stream(self.device))
        self.was_read[m][slot] = True

    def mark_read(self, m: int, slots, event) -> None:
        """One kernel read all of `slots`: one event (recorded after it) stands for each."""
        for s in slots:
            if self.cuda:
                self.read[m][s] = event
            self.was_read[m][s] = True
