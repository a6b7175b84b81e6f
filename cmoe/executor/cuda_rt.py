"""The CUDA runtime torch loaded, called through ctypes for the calls on the host's path of every
layer (issue 13), and the timing marks made with its events.

Why not torch's own calls: each goes through Python wrappers and the dispatcher before it
reaches the runtime. Measured on the H200's host (`benchmarks/host_ops_h200.py`, median per
call, `benchmarks/results/lean-h200-6/host-ops.json`): a timing mark, which needs a new event
unless events are kept, costs 3.09 us through torch (a new `torch.cuda.Event(enable_timing=True)`
and its `record`; recording a kept torch event again, 1.66 us) against 0.84 us for the runtime's
`cudaEventRecord` on an event made ahead; an expert's copy 9.65 us through torch's `copy_` against
2.55 us for `cudaMemcpyAsync`. A stream's wait costs the same either way (torch's `wait_event`
0.82-0.88 us, `cudaStreamWaitEvent` 0.83 us): it goes through the runtime because the runtime's
events do. What the whole step gained is in BENCHMARKS.md (seventh session). It is the same library
torch calls (found in the process's own maps, its major version checked against torch's), so
the same context, streams and events: a handle from torch (`stream.cuda_stream`) is valid here.

`Marks` times points on streams with events made ahead (`reserve`) and reused: a mark's event
goes back to the pool the moment its time is read (`us`), never before, so an event is never
recorded again while its time may still be wanted. A mark whose time was read has happened, so
a stream that would wait for it need not (`Mark.ev` is then None).
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext

import torch

H2D, D2H, D2D = 1, 2, 3            # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, DeviceToDevice
DISABLE_TIMING = 2                 # cudaEventDisableTiming: an event only for ordering
NOT_READY = 600                    # cudaErrorNotReady


class Runtime:
    """ctypes bindings of the runtime calls the executor makes, each bound once. A call that fails
    raises RuntimeError with the runtime's own message, and clears the thread's last error first,
    as torch does, so that torch's next check does not report it again."""

    _one: "Runtime | None | bool" = False                      # False: not looked for yet

    def __init__(self, lib, path: str = ""):
        self._lib, self.path = lib, path
        p, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint

        def bind(name, *args):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(args), ctypes.c_int
            return f
        self._memcpy = bind("cudaMemcpyAsync", p, p, ctypes.c_size_t, i, p)
        sz = ctypes.c_size_t
        self._memset2d = bind("cudaMemset2DAsync", p, sz, i, sz, sz, p)
        self._create = bind("cudaEventCreateWithFlags", ctypes.POINTER(p), u)
        self._record = bind("cudaEventRecord", p, p)
        self._wait = bind("cudaStreamWaitEvent", p, p, u)
        self._sync = bind("cudaEventSynchronize", p)
        self._query = bind("cudaEventQuery", p)
        self._elapsed = bind("cudaEventElapsedTime", ctypes.POINTER(ctypes.c_float), p, p)
        self._destroy = bind("cudaEventDestroy", p)
        self._launch = bind("cudaGraphLaunch", p, p)
        self._last = bind("cudaGetLastError")
        lib.cudaGetErrorString.argtypes = [i]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._err = lib.cudaGetErrorString
        self._ms = ctypes.c_float(0.0)
        self._ms_p = ctypes.pointer(self._ms)

    @classmethod
    def get(cls) -> "Runtime | None":
        if cls._one is False:
            cls._one = None
            try:
                with open("/proc/self/maps") as f:
                    paths = [ln.split(None, 5)[-1].strip() for ln in f if "libcudart.so" in ln]
            except OSError:
                paths = []
            paths = [p for p in paths if not p.endswith("(deleted)")]
            for path in dict.fromkeys(paths):          # each mapped runtime, until one matches torch's
                try:
                    rt = cls(ctypes.CDLL(path), path)
                except (OSError, AttributeError):
                    continue
                if rt.matches_torch():
                    cls._one = rt
                    break
        return cls._one

    def matches_torch(self) -> bool:
        """The runtime's major version is the one torch was built with (a second CUDA runtime in the
        process, loaded by another library, would have its own context state)."""
        v = ctypes.c_int(0)
        if self._lib.cudaRuntimeGetVersion(ctypes.byref(v)) != 0 or torch.version.cuda is None:
            return False
        return v.value // 1000 == int(torch.version.cuda.split(".")[0])

    def _fail(self, name: str, rc: int):
        self._last()
        raise RuntimeError(f"{name} failed: {self._err(rc).decode()}")

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """cudaMemcpyAsync on `stream`; kind H2D or D2H (the host side pinned, or the copy is not
        asynchronous)."""
        rc = self._memcpy(dst, src, nbytes, kind, stream)
        if rc:
            self._fail("cudaMemcpyAsync", rc)

    def memset2d(self, ptr: int, pitch: int, value: int, width: int, height: int, stream: int) -> None:
        """cudaMemset2DAsync on `stream`: `height` rows of `width` bytes, `pitch` bytes apart, set
        to `value` (one column of a row-major byte matrix: width 1, pitch its row length)."""
        rc = self._memset2d(ptr, pitch, value, width, height, stream)
        if rc:
            self._fail("cudaMemset2DAsync", rc)

    def event(self, flags: int = 0) -> int:
        """A new event: flags 0 times, DISABLE_TIMING only orders."""
        h = ctypes.c_void_p()
        rc = self._create(ctypes.byref(h), flags)
        if rc:
            self._fail("cudaEventCreateWithFlags", rc)
        return h.value

    def record(self, ev: int, stream: int) -> None:
        rc = self._record(ev, stream)
        if rc:
            self._fail("cudaEventRecord", rc)

    def wait(self, stream: int, ev: int) -> None:
        """`stream` waits for the work `ev` was last recorded behind (a later record does not move it)."""
        rc = self._wait(stream, ev, 0)
        if rc:
            self._fail("cudaStreamWaitEvent", rc)

    def sync(self, ev: int) -> None:
        rc = self._sync(ev)
        if rc:
            self._fail("cudaEventSynchronize", rc)

    def query(self, ev: int) -> bool:
        rc = self._query(ev)
        if rc == NOT_READY:
            self._last()                     # not an error: cleared, as torch's own query does
            return False
        if rc:
            self._fail("cudaEventQuery", rc)
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        rc = self._elapsed(self._ms_p, start, end)
        if rc:
            self._fail("cudaEventElapsedTime", rc)
        return self._ms.value

    def destroy(self, ev: int) -> None:
        rc = self._destroy(ev)
        if rc:
            self._fail("cudaEventDestroy", rc)

    def launch(self, graph_exec: int, stream: int) -> None:
        """cudaGraphLaunch of an instantiated graph (`torch.cuda.CUDAGraph.raw_cuda_graph_exec()`) on
        `stream`: what the compiled host program calls, without torch's wrapper."""
        rc = self._launch(graph_exec, stream)
        if rc:
            self._fail("cudaGraphLaunch", rc)


class Mark:
    """A point on a stream: `ev`, the event recorded there, until its time is read into `t`
    (microseconds after the reference); then `ev` is None and the event serves other marks."""

    __slots__ = ("ev", "t")

    def __init__(self, ev: int):
        self.ev, self.t = ev, None


class Marks:
    """Timing marks on the runtime's events, from a pool made ahead: one runtime call a mark."""

    def __init__(self, rt: Runtime, stream: int, device: int | None = None):
        self.rt, self.device = rt, device
        self.free: list[int] = []              # events whose last mark was read
        self.made: list[int] = []              # every event made here (the pool's, the reference, ordering ones)
        self.late = 0                          # events made on demand, the reserve being used up
        self.closed = False
        with self._on():
            self.ref = self._new(0)            # the clock's zero: the marks' times are read against it
        rt.record(self.ref, stream)

    def _on(self):
        """The clock's device made current, for making events (they belong to the current device)."""
        return torch.cuda.device(self.device) if self.device is not None else nullcontext()

    def _new(self, flags: int) -> int:
        ev = self.rt.event(flags)
        self.made.append(ev)
        return ev

    def reserve(self, n: int) -> None:
        """Make events until n are free (before timing: a mark then only records)."""
        self._check()
        with self._on():
            while len(self.free) < n:
                self.free.append(self._new(0))

    def order_event(self) -> int:
        """An event for ordering alone (no timing), the caller's for as long as the clock lives."""
        self._check()
        with self._on():
            return self._new(DISABLE_TIMING)

    def _check(self) -> None:
        if self.closed:
            raise RuntimeError("the clock's events were destroyed (Clock.close): its marks cannot be made or read")

    def mark(self, stream: int) -> Mark:
        if self.closed:
            self._check()
        if self.free:
            ev = self.free.pop()
        else:
            self.late += 1
            with self._on():
                ev = self._new(0)
        self.rt.record(ev, stream)
        return Mark(ev)

    def us(self, m: Mark) -> float:
        """The mark's time, read once (it must have happened); its event then goes back to the pool."""
        t = m.t
        if t is None:
            self._check()
            t = m.t = self.rt.elapsed_ms(self.ref, m.ev) * 1e3
            self.free.append(m.ev)
            m.ev = None
        return t

    def done(self, m: Mark) -> bool:
        if m.t is not None:
            return True
        self._check()
        return self.rt.query(m.ev)

    def wait(self, m: Mark) -> None:
        if m.t is None:
            self._check()
            self.rt.sync(m.ev)

    def close(self) -> None:
        """Destroy every event made here (after the device has finished with them); every one is
        tried, and the first failure raised after. Closing twice does nothing."""
        if self.closed:
            return
        self.closed = True
        made, self.made, self.free = self.made, [], []
        err = None
        for ev in made:
            try:
                self.rt.destroy(ev)
            except RuntimeError as e:
                err = err or e
        if err is not None:
            raise err
