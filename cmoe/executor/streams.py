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

The host's cost of a load is on every loading policy's critical path, so a load makes as few
calls as it can. Measured on the H200's host (`benchmarks/host_ops_h200.py`, median per call):
torch's `copy_` of an expert's 91 MB pinned slice costs 9.7 us and entering the copy stream's
context 8.8 us, where the CUDA runtime's own `cudaMemcpyAsync` on that stream costs 2.6 us;
`torch.cuda.current_stream()` costs 4.7 us. So a load calls the runtime torch loaded directly
(`_Runtime`; the pinned store outlives every copy, so torch's pinned-memory bookkeeping has
nothing to track), and the compute stream is looked up once per pass (`DevicePool.compute`),
not per read. Where the runtime is not found (not Linux, a static build), loads go through
torch as before.
"""

from __future__ import annotations

import ctypes
import time

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
        # the stream the kernels read on: the engine sets it when a pass starts (`Engine.run_pass`)
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self._rt = _Runtime.get() if self.cuda else None          # the runtime loads are copied with
        self._direct_ok: dict[int, bool] = {}                     # source address -> a direct copy is right
        self._cp_handle = self.copy_stream.cuda_stream if self.cuda else 0
        self._dst_ptr = [[r.data_ptr() for r in raw] for raw in self.raw]
        self._nbytes = expert.nbytes
        self.ready = [[torch.cuda.Event() if self.cuda else None for _ in range(n)] for n in layout.slots]
        self.read = [[torch.cuda.Event() if self.cuda else None for _ in range(n)] for n in layout.slots]
        self.pending = [[False] * n for n in layout.slots]         # a load not yet waited for by compute
        self.was_read = [[False] * n for n in layout.slots]

    def load(self, m: int, slot: int, e: int, src: torch.Tensor, clock: Clock):
        """Copy expert e's host bytes into a slot on the copy stream. Returns (start, end) marks."""
        dst = self.raw[m][slot]
        if self.cuda:
            cp = self.copy_stream
            if self.was_read[m][slot]:
                cp.wait_event(self.read[m][slot])
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
                                           and src.is_contiguous() and src.is_pinned() and src.numel() >= self._nbytes)
        if ok:
            rt.h2d(self._dst_ptr[m][slot], sp, self._nbytes, self._cp_handle)
        return ok

    def before_read(self, m: int, slot: int) -> None:
        if self.pending[m][slot]:
            if self.cuda:
                self.compute.wait_event(self.ready[m][slot])
            self.pending[m][slot] = False

    def after_read(self, m: int, slot: int) -> None:
        if self.cuda:
            self.read[m][slot].record(self.compute)
        self.was_read[m][slot] = True

    def mark_read(self, m: int, slots, event) -> None:
        """One kernel read all of `slots`: one event (recorded after it) stands for each."""
        for s in slots:
            if self.cuda:
                self.read[m][s] = event
            self.was_read[m][s] = True


class _Runtime:
    """The CUDA runtime library torch loaded, called through ctypes for host-to-device copies on a
    stream torch owns (the same library, so the same context and stream handles)."""

    _one: "_Runtime | None | bool" = False                      # False: not looked for yet

    def __init__(self, path: str):
        lib = self._lib = ctypes.CDLL(path)
        f = lib.cudaMemcpyAsync
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        f.restype = ctypes.c_int
        self._memcpy = f
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._err = lib.cudaGetErrorString
        self.path = path

    @classmethod
    def get(cls) -> "_Runtime | None":
        if cls._one is False:
            cls._one = None
            try:
                with open("/proc/self/maps") as f:
                    paths = [ln.split(None, 5)[-1].strip() for ln in f if "libcudart.so" in ln]
            except OSError:
                paths = []
            paths = [p for p in paths if not p.endswith("(deleted)")]
            if paths:
                try:
                    rt = cls(paths[0])
                    cls._one = rt if rt.matches_torch() else None
                except (OSError, AttributeError):
                    cls._one = None
        return cls._one

    def matches_torch(self) -> bool:
        """The runtime's major version is the one torch was built with (a second CUDA runtime in the
        process, loaded by another library, would have its own context state)."""
        v = ctypes.c_int(0)
        if self._lib.cudaRuntimeGetVersion(ctypes.byref(v)) != 0 or torch.version.cuda is None:
            return False
        return v.value // 1000 == int(torch.version.cuda.split(".")[0])

    def h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._memcpy(dst, src, nbytes, 1, stream)           # 1: cudaMemcpyHostToDevice
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed: {self._err(rc).decode()}")
