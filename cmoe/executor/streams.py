"""Time and ordering on the device: a clock that marks points on a stream, and the GPU slot pool
with its copy stream.

On CUDA a mark is a timing event recorded on a stream (read back once the pass is over, so
measuring never stalls the pipeline), and ordering goes through one event per slot and
direction: `ready` (a load's end mark, on the copy stream) and `read` (the end mark of the last
launch that read the slot, or the slot's own event recorded after a kernel, on the compute
stream). A load waits for `read` before overwriting; a kernel waits for `ready` before reading.
On the CPU everything is synchronous: marks are `perf_counter` readings and waits are no-ops, so
the same engine code runs in the tests. Host-side spans (CPU experts, round trips) are placed on
the device clock through the offset taken when the clock started, right after a full
synchronisation.

The host's cost of every call here is on a loading policy's critical path (issue 13), so the
calls go to the CUDA runtime torch loaded, through ctypes (`cmoe.executor.cuda_rt`). Measured on
the H200's host (`benchmarks/host_ops_h200.py`, median per call,
`benchmarks/results/lean-h200-6/host-ops.json`): a new torch timing event and its `record` 3.09 us
(a kept one recorded again 1.66) against the runtime's `cudaEventRecord` 0.84 us on an event made
ahead (`cuda_rt.Marks`); a stream's wait the same either way (0.82-0.88 us); torch's `copy_` of an expert's 91 MB pinned
slice 9.7 us and entering the copy stream's context 8.8 us, where `cudaMemcpyAsync` on that
stream costs 2.6 us (the pinned store outlives every copy, so torch's pinned-memory bookkeeping
has nothing to track); `torch.cuda.current_stream()` 4.7 us, so the compute stream is looked up
once per pass (`DevicePool.use_compute`), not per read. A mark whose time has been read gives
its event back, and a wait for it is skipped: it has happened. Where the runtime is not found
(not Linux, a static build), everything goes through torch as before (`Clock.calls` says which).
"""

from __future__ import annotations

import time

import torch

from cmoe.executor.cuda_rt import DISABLE_TIMING, H2D, Mark, Marks, Runtime
from cmoe.executor.kernels import ExpertViews
from cmoe.executor.layout import ExpertLayout
from cmoe.policy.pool import PoolLayout

def marks_per_layer(rows: int, top_k: int, experts: int, waves: int = 2) -> int:
    """The most timing marks a layer makes, for the events made before timing (`run_events`): a
    loading policy's layer makes four in one launch (its entry, plan, launch start and end), in more
    launches (waves) two a further launch and an exit mark, and two a load; a layer loads at most
    the experts its rows route to (rows * top_k) or the layer's experts."""
    return 5 + 2 * (waves - 1) + 2 * min(experts, rows * top_k)


def run_events(passes: int, layers: int, experts: int, top_k: int, batch: int, each_pass: bool) -> int:
    """The timing events a run marks with, made before timing: the first pass (the prefill) may
    load any expert, a decode pass those its rows route to; an engine that reads its marks after
    every pass (the reference) reuses them, so two passes' worth do. At most RESERVE_MAX: a
    many-expert model's bound would make far more than it uses, and a run past it reports the
    events it made late (`late_events`)."""
    if each_pass:
        passes = min(passes, 2)
    first = 2 + layers * marks_per_layer(experts, 1, experts)
    return min(RESERVE_MAX, first + (passes - 1) * (2 + layers * marks_per_layer(batch, top_k, experts)))


RESERVE_MAX = 1 << 17       # events made before timing at most (Mixtral, 256 tokens, batch 1: 91,362)


class Clock:
    """rt: the runtime to time with on CUDA (default: the one torch loaded, `Runtime.get()`);
    None: torch's events."""

    def __init__(self, device: torch.device, rt: "Runtime | None | bool" = True):
        self.cuda, self.device = device.type == "cuda", device
        self.rt = None
        self._marks: Marks | None = None
        if self.cuda:
            rt = Runtime.get() if rt is True else rt
            stream = torch.cuda.current_stream(device)
            if rt is not None:
                self.rt = rt
                self._marks = Marks(rt, stream.cuda_stream, device.index)
            else:
                self.ref = torch.cuda.Event(enable_timing=True)
                self.ref.record(stream)
            torch.cuda.synchronize(device)
        self.host0 = time.perf_counter()
        self.epoch0 = time.time()            # host0 on the wall clock: lines the timeline up with other logs

    @property
    def calls(self) -> str:
        """Which calls time and order the run: host (the CPU), runtime (the CUDA runtime), torch."""
        return "host" if not self.cuda else "runtime" if self._marks is not None else "torch"

    @property
    def late(self) -> int:
        """Timing events made during the run because the reserve ran out (0 with torch)."""
        return self._marks.late if self._marks is not None else 0

    def host(self) -> float:
        """Now, on the host, in microseconds since the clock started."""
        return (time.perf_counter() - self.host0) * 1e6

    def mark(self, stream=None):
        if not self.cuda:
            return self.host()
        if self._marks is not None:
            return self._marks.mark((stream if stream is not None else torch.cuda.current_stream(self.device)).cuda_stream)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def done(self, h) -> bool:
        if type(h) is Mark:
            return self._marks.done(h)
        return isinstance(h, float) or h.query()

    def us(self, h) -> float:
        if type(h) is Mark:
            return self._marks.us(h)
        return h if isinstance(h, float) else self.ref.elapsed_time(h) * 1e3

    def wait(self, h) -> None:
        """The host waits until the mark has happened."""
        if type(h) is Mark:
            self._marks.wait(h)
        elif not isinstance(h, float):
            h.synchronize()

    def reserve_events(self, n: int) -> None:
        """Before timing: n timing events free, made now (runtime clocks; torch makes its own): a
        run's are `run_events`."""
        if self._marks is not None:
            self._marks.reserve(n)

    def order_event(self) -> int:
        """A runtime event for ordering alone, destroyed with the clock (runtime clocks only)."""
        return self._marks.order_event()

    def close(self) -> None:
        """After the run's last read: the clock's events destroyed (its marks cannot be read again)."""
        if self._marks is not None:
            self._marks.close()


class DevicePool:
    """One pre-allocated buffer carved into equal slots per block, plus the copy stream. rt: the
    runtime loads and waits go through (default: `Runtime.get()`; None: torch)."""

    def __init__(self, layout: PoolLayout, expert: ExpertLayout, device: torch.device, views: bool = True,
                 rt: "Runtime | None | bool" = True):
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
        self.compute = self.compute_h = None                      # the stream kernels read on (`use_compute`)
        if self.cuda:
            self.use_compute(torch.cuda.current_stream(device))
        self._rt = (Runtime.get() if rt is True else rt) if self.cuda else None
        self._direct_ok: dict[int, bool] = {}                     # source address -> a direct copy is right
        self._cp_handle = self.copy_stream.cuda_stream if self.cuda else 0
        self._dst_ptr = [[r.data_ptr() for r in raw] for raw in self.raw]
        self.expert_nbytes = expert.nbytes                       # a slot's bytes of an expert, every copy's size
        self._forget()

    def _forget(self) -> None:
        """No slot has anything in flight (a new pool, or the device synchronised)."""
        slots = self.layout.slots
        self.ready = [[None] * n for n in slots]                  # the mark a reader waits for
        self.read = [[None] * n for n in slots]                   # what a load into the slot waits for
        self.own_read = [[None] * n for n in slots]               # the slot's own read event (`after_read`)
        self.pending = [[False] * n for n in slots]               # a load not yet waited for by compute
        self.was_read = [[False] * n for n in slots]

    def use_compute(self, stream):
        """The stream kernels read on, set when a pass starts; returns it."""
        self.compute, self.compute_h = stream, stream.cuda_stream
        return stream

    def load(self, m: int, slot: int, e: int, src: torch.Tensor, clock: Clock):
        """Copy expert e's host bytes into a slot on the copy stream. Returns (start, end) marks."""
        dst = self.raw[m][slot]
        if self.cuda:
            cp = self.copy_stream
            if self.was_read[m][slot]:
                self._wait(cp, self._cp_handle, self.read[m][slot])
            t0 = clock.mark(cp)
            if not self._direct(m, slot, src):
                with torch.cuda.stream(cp):
                    dst.copy_(src[: dst.numel()], non_blocking=True)
            t1 = clock.mark(cp)
            self.ready[m][slot] = t1                  # the end mark is the event a reader waits for
        else:
            t0 = clock.mark()
            dst.copy_(src[: dst.numel()])
            t1 = clock.mark()
        self.expert[m][slot] = e
        self.pending[m][slot] = True
        return t0, t1

    def _direct(self, m: int, slot: int, src: torch.Tensor) -> bool:
        """Slot (m, slot) <- the expert's first bytes of `src`, by the runtime's cudaMemcpyAsync on
        the copy stream, when `src` is contiguous pinned host memory holding a whole expert (checked
        the first time each source address is met). False: not done, the caller copies."""
        rt = self._rt
        if rt is None:
            return False
        sp = src.data_ptr()
        ok = self._direct_ok.get(sp)
        if ok is None:
            ok = self._direct_ok[sp] = bool(src.device.type == "cpu" and src.dtype == torch.uint8
                                           and src.is_contiguous() and src.is_pinned() and src.numel() >= self.expert_nbytes)
        if ok:
            rt.copy(self._dst_ptr[m][slot], sp, self.expert_nbytes, H2D, self._cp_handle)
        return ok

    def _wait(self, stream, handle: int, ev) -> bool:
        """`stream` (torch's, and its handle) waits for `ev`: a runtime mark (none once its time was
        read: it has happened), a runtime event, or a torch event. Returns whether a wait was queued."""
        if type(ev) is Mark or type(ev) is int:
            if self._rt is None:
                raise RuntimeError("a runtime event reached a pool built without the runtime: build the "
                                   "DevicePool with its clock's runtime (rt=clock.rt)")
            if type(ev) is int:
                self._rt.wait(handle, ev)
            elif ev.ev is not None:
                self._rt.wait(handle, ev.ev)
            else:
                return False
        else:
            stream.wait_event(ev)
        return True

    def before_read(self, m: int, slot: int) -> bool:
        """The compute stream waits for the slot's pending copy, once. Returns whether a wait was
        queued on it (none on the CPU, none for a copy known to have landed)."""
        waited = False
        if self.pending[m][slot]:
            if self.cuda:
                waited = self._wait(self.compute, self.compute_h, self.ready[m][slot])
            self.pending[m][slot] = False
        return waited

    def after_read(self, m: int, slot: int) -> None:
        """A kernel read the slot: its own read event recorded on the compute stream."""
        if self.cuda:
            own = self.own_read[m][slot]
            if self._rt is not None:
                if own is None:
                    with torch.cuda.device(self.device):   # an event belongs to the device current when made
                        own = self.own_read[m][slot] = self._rt.event(DISABLE_TIMING)
                self._rt.record(own, self.compute_h)
            else:
                if own is None:
                    own = self.own_read[m][slot] = torch.cuda.Event()
                own.record(self.compute)
            self.read[m][slot] = own
        self.was_read[m][slot] = True

    def mark_read(self, m: int, slots, event) -> None:
        """One kernel read all of `slots`: one event (recorded after it) stands for each."""
        for s in slots:
            if self.cuda:
                self.read[m][s] = event
            self.was_read[m][s] = True

    def settle(self) -> None:
        """After the device has been synchronised: nothing is in flight, so nothing waits, and the
        slots' own runtime events are destroyed."""
        if self._rt is not None:
            for ev in (e for row in self.own_read for e in row if e is not None):
                self._rt.destroy(ev)
        self._forget()


def sleep_cycles(us: float, device: torch.device) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for `us` microseconds (measured once)."""
    n = 10_000_000
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):              # an idle GPU clocks down: spin long enough for it to clock up first
        torch.cuda._sleep(n)
    s.record()
    torch.cuda._sleep(n)
    e.record()
    e.synchronize()
    return int(n * us / (s.elapsed_time(e) * 1e3))
