"""The executor's host calls on CUDA (`cmoe.executor.cuda_rt`, `cmoe.executor.streams`), checked on
the CPU with a stand-in runtime that records every call: timing marks on events made ahead and
reused only once their time was read, the waits a read mark no longer needs, the choice between
the runtime and torch's fallback, and the ctypes bindings' errors. The same on a GPU:
test_host_calls_gpu.py."""

from __future__ import annotations

import contextlib
import ctypes
import random
from types import SimpleNamespace

import pytest
import torch

from cmoe.executor.cuda_rt import DISABLE_TIMING, H2D, NOT_READY, Mark, Marks, Runtime
from cmoe.executor.streams import Clock, DevicePool


class FakeRuntime:
    """Stands in for `cuda_rt.Runtime`: events are numbers, a record takes the next tick of a
    fake device clock, and every call is kept in `calls`."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.made = 0
        self.at: dict[int, int] = {}
        self.tick = 0
        self.pending: set[int] = set()
        self.fail_destroy: set[int] = set()

    def event(self, flags=0):
        self.made += 1
        self.calls.append(("event", flags))
        return 100 + self.made

    def record(self, ev, stream):
        self.tick += 1
        self.at[ev] = self.tick
        self.calls.append(("record", ev, stream))

    def wait(self, stream, ev):
        self.calls.append(("wait", stream, ev))

    def sync(self, ev):
        self.calls.append(("sync", ev))

    def query(self, ev):
        self.calls.append(("query", ev))
        return ev not in self.pending

    def elapsed_ms(self, start, end):
        self.calls.append(("elapsed", start, end))
        return (self.at[end] - self.at[start]) / 1e3             # one tick: 1 us

    def destroy(self, ev):
        self.calls.append(("destroy", ev))
        if ev in self.fail_destroy:
            raise RuntimeError(f"cudaEventDestroy failed: event {ev}")

    def copy(self, dst, src, n, kind, stream):
        self.calls.append(("copy", dst, src, n, kind, stream))

    def take(self):
        out, self.calls = self.calls, []
        return out


class _TorchEvent:
    made: list = []

    def __init__(self, enable_timing=False):
        self.timing, self.recorded, self.synced = enable_timing, [], 0
        _TorchEvent.made.append(self)

    def record(self, stream=None):
        self.recorded.append(stream)

    def synchronize(self):
        self.synced += 1

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.25


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA calls a Clock makes, faked: the current stream (handle 7), synchronize, Event."""
    stream = SimpleNamespace(cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", _TorchEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
    _TorchEvent.made = []
    return stream


def test_a_pass_of_marks_makes_its_events_once_and_the_next_pass_reuses_them():
    rt = FakeRuntime()
    mk = Marks(rt, stream=7)
    ref = mk.ref
    assert rt.take() == [("event", 0), ("record", ref, 7)]
    mk.reserve(4)
    assert rt.take() == [("event", 0)] * 4
    first = [mk.mark(7) for _ in range(4)]
    evs = [m.ev for m in first]
    assert rt.take() == [("record", ev, 7) for ev in evs]          # a mark: one call, no event made
    assert len(set(evs)) == 4 and ref not in evs
    assert [mk.us(m) for m in first] == [1.0, 2.0, 3.0, 4.0]
    assert rt.take() == [("elapsed", ref, ev) for ev in evs]
    assert all(m.ev is None for m in first)                        # read: the events are back
    second = [mk.mark(3) for _ in range(4)]
    assert {m.ev for m in second} == set(evs) and mk.late == 0
    assert [c[0] for c in rt.take()] == ["record"] * 4
    assert [mk.us(m) for m in first] == [1.0, 2.0, 3.0, 4.0]       # the first pass's times stay
    assert rt.take() == []
    extra = mk.mark(3)                                             # past the reserve: made on demand
    assert mk.late == 1 and rt.take() == [("event", 0), ("record", extra.ev, 3)]
    mk.close()
    assert sorted(rt.take()) == sorted(("destroy", ev) for ev in [ref] + evs + [extra.ev])


def test_an_event_is_never_handed_to_two_unread_marks():
    """Random marks and reads: no two unread marks share an event, a read mark keeps its time
    while its event serves others, and the pool never makes more events than were ever unread."""
    rt = FakeRuntime()
    mk = Marks(rt, stream=1)
    mk.reserve(3)
    rng = random.Random(5)
    unread: list[Mark] = []
    read: list[tuple[Mark, float]] = []
    most = 0
    for _ in range(400):
        if unread and rng.random() < 0.45:
            m = unread.pop(rng.randrange(len(unread)))
            read.append((m, mk.us(m)))
        else:
            unread.append(mk.mark(1))
        most = max(most, len(unread))
        live = [m.ev for m in unread]
        assert len(set(live)) == len(live) and None not in live
        assert mk.ref not in live
    assert all(m.ev is None and mk.us(m) == t for m, t in read)
    assert rt.made == 1 + max(3, most)
    assert mk.late == max(0, most - 3)


def test_a_read_mark_is_done_and_needs_no_wait(fake_cuda):
    rt = FakeRuntime()
    clock = Clock(torch.device("cuda"), rt=rt)
    rt.take()
    a, b = clock.mark(fake_cuda), clock.mark(fake_cuda)
    rt.pending.add(b.ev)
    assert clock.done(a) and not clock.done(b)
    clock.wait(b)
    assert rt.take()[-3:] == [("query", a.ev), ("query", b.ev), ("sync", b.ev)]
    clock.us(a)
    rt.take()
    assert clock.done(a)
    clock.wait(a)
    assert rt.take() == []
    # a stream waiting for a slot's mark: the runtime's wait while unread, none once read; a slot's
    # own event through the runtime too, and a torch event through torch
    pool = SimpleNamespace(_rt=rt)
    waited = []
    stream = SimpleNamespace(wait_event=waited.append)
    for ev in (a, b, 55, "torch event"):
        DevicePool._wait(pool, stream, 9, ev)
    assert rt.take() == [("wait", 9, b.ev), ("wait", 9, 55)] and waited == ["torch event"]


def test_the_clock_takes_the_runtime_and_falls_back_to_torch_without_it(fake_cuda, monkeypatch):
    cuda = torch.device("cuda")
    rt = FakeRuntime()
    on_rt = Clock(cuda, rt=rt)
    assert on_rt.calls == "runtime" and on_rt.rt is rt and _TorchEvent.made == []
    m = on_rt.mark(SimpleNamespace(cuda_stream=3))
    assert type(m) is Mark and rt.calls[-1] == ("record", m.ev, 3)
    on_rt.reserve_events(46)
    assert sum(c[0] == "event" for c in rt.calls) == 2 + 46
    assert on_rt.order_event() and rt.calls[-1] == ("event", DISABLE_TIMING)
    made = rt.made
    on_rt.close()
    assert len([c for c in rt.calls if c[0] == "destroy"]) == made
    rt.calls = []
    torch_clock = Clock(cuda, rt=None)
    assert torch_clock.calls == "torch" and torch_clock.rt is None and torch_clock.late == 0
    ref, = _TorchEvent.made
    assert ref.timing and ref.recorded == [fake_cuda]
    s = SimpleNamespace(cuda_stream=3)
    ev = torch_clock.mark(s)
    assert isinstance(ev, _TorchEvent) and ev.recorded == [s] and torch_clock.us(ev) == 250.0
    torch_clock.wait(ev)
    before = len(_TorchEvent.made)
    torch_clock.reserve_events(46)                                     # torch makes its events as it marks
    torch_clock.close()
    assert ev.synced == 1 and len(_TorchEvent.made) == before and rt.calls == []
    monkeypatch.setattr(Runtime, "get", classmethod(lambda cls: None))   # not found: torch
    assert Clock(cuda).calls == "torch"
    monkeypatch.setattr(Runtime, "get", classmethod(lambda cls: rt))
    assert Clock(cuda).calls == "runtime"
    cpu = Clock(torch.device("cpu"))
    assert cpu.calls == "host" and isinstance(cpu.mark(), float) and cpu.late == 0


class _FakeLib:
    """A CUDA runtime library's calls as ctypes binds them, answering with set return codes."""

    def __init__(self):
        self.rc: dict[str, int] = {}
        self.calls: list[str] = []
        for name in ("cudaMemcpyAsync", "cudaMemset2DAsync", "cudaEventCreateWithFlags", "cudaEventRecord",
                     "cudaStreamWaitEvent",
                     "cudaEventSynchronize", "cudaEventQuery", "cudaEventElapsedTime", "cudaEventDestroy",
                     "cudaGraphLaunch", "cudaGetLastError"):
            setattr(self, name, self._call(name))
        self.cudaGetErrorString = lambda rc: f"error {rc}".encode()

    def _call(self, name):
        def f(*args):
            self.calls.append(name)
            if name == "cudaEventCreateWithFlags":
                args[0]._obj.value = 0xE0
            if name == "cudaEventElapsedTime":
                args[0].contents.value = 1.5
            return self.rc.get(name, 0)
        return f


def test_the_runtime_binds_its_calls_and_raises_with_its_message():
    lib = _FakeLib()
    rt = Runtime(lib)
    assert lib.cudaEventRecord.argtypes == [ctypes.c_void_p, ctypes.c_void_p]
    assert lib.cudaEventQuery.restype is ctypes.c_int
    size = ctypes.c_size_t
    assert lib.cudaMemset2DAsync.argtypes == [ctypes.c_void_p, size, ctypes.c_int, size, size, ctypes.c_void_p]
    assert lib.cudaGraphLaunch.argtypes == [ctypes.c_void_p, ctypes.c_void_p]
    assert rt.event(DISABLE_TIMING) == 0xE0 and rt.elapsed_ms(1, 2) == 1.5 and rt.query(1)
    lib.rc["cudaEventQuery"] = NOT_READY
    lib.calls = []
    assert not rt.query(1) and lib.calls == ["cudaEventQuery", "cudaGetLastError"]   # cleared, not raised
    lib.rc["cudaEventQuery"] = 400
    with pytest.raises(RuntimeError, match="cudaEventQuery failed: error 400"):
        rt.query(1)
    for name, call in (("cudaEventRecord", lambda: rt.record(1, 2)), ("cudaStreamWaitEvent", lambda: rt.wait(2, 1)),
                       ("cudaEventSynchronize", lambda: rt.sync(1)), ("cudaMemcpyAsync", lambda: rt.copy(1, 2, 3, 2, 4)),
                       ("cudaEventDestroy", lambda: rt.destroy(1)), ("cudaEventElapsedTime", lambda: rt.elapsed_ms(1, 2)),
                       ("cudaEventCreateWithFlags", lambda: rt.event()),
                       ("cudaMemset2DAsync", lambda: rt.memset2d(1, 16, 1, 1, 2, 4)),
                       ("cudaGraphLaunch", lambda: rt.launch(1, 2))):
        lib.rc[name] = 1
        lib.calls = []
        with pytest.raises(RuntimeError, match=f"{name} failed: error 1"):
            call()
        assert lib.calls == [name, "cudaGetLastError"]


def _fake_pool(rt, slots=2, nbytes=4):
    """A DevicePool on a faked device: copy stream handle 11, compute stream handle 7, slot
    addresses 1000, 2000, .. (its constructor allocates on the device, so it is put together here)."""
    pool = DevicePool.__new__(DevicePool)
    pool.layout = SimpleNamespace(slots=[slots])
    pool.device, pool.cuda, pool._rt = torch.device("cuda"), True, rt
    pool.raw = [[torch.zeros(nbytes, dtype=torch.uint8) for _ in range(slots)]]
    pool.expert = [[-1] * slots]
    pool.copy_stream, pool._cp_handle = SimpleNamespace(cuda_stream=11), 11
    pool.compute, pool.compute_h = SimpleNamespace(cuda_stream=7), 7
    pool._dst_ptr = [[1000 * (s + 1) for s in range(slots)]]
    pool.expert_nbytes, pool._direct_ok = nbytes, {}
    pool._forget()
    return pool


def test_a_slot_is_loaded_read_and_loaded_again_in_order(fake_cuda, monkeypatch):
    """A load waits for the slot's last read before its start mark, copies by the runtime between
    its two marks; a read waits for the load's end mark, once; the slot's own read event is made
    once and recorded after each read; the next load waits for it; settle destroys it."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    rt = FakeRuntime()
    clock = Clock(torch.device("cuda"), rt=rt)
    clock.reserve_events(8)
    pool = _fake_pool(rt)
    src = torch.arange(6, dtype=torch.uint8)
    rt.take()
    t0, t1 = pool.load(0, 1, 5, src, clock)
    assert rt.take() == [("record", t0.ev, 11), ("copy", 2000, src.data_ptr(), 4, H2D, 11), ("record", t1.ev, 11)]
    assert pool.expert[0] == [-1, 5] and pool.ready[0][1] is t1 and pool.pending[0][1]
    assert pool.before_read(0, 1) is True
    assert pool.before_read(0, 1) is False                        # waited once: no second wait
    assert rt.take() == [("wait", 7, t1.ev)]
    pool.after_read(0, 1)
    own = pool.own_read[0][1]
    pool.after_read(0, 1)
    assert rt.take() == [("event", DISABLE_TIMING), ("record", own, 7), ("record", own, 7)]
    u0, u1 = pool.load(0, 1, 6, src, clock)
    assert rt.take() == [("wait", 11, own), ("record", u0.ev, 11), ("copy", 2000, src.data_ptr(), 4, H2D, 11),
                         ("record", u1.ev, 11)]
    clock.us(u1)                                                   # its time read: it has happened
    rt.take()
    assert pool.before_read(0, 1) is False                        # pending, but landed: no wait queued
    assert rt.take() == [] and not pool.pending[0][1]
    pool.settle()
    assert rt.take() == [("destroy", own)]
    assert pool.own_read == [[None, None]] and pool.was_read == [[False, False]]
    torch_pool = _fake_pool(None)                                  # a runtime mark and a pool without the runtime
    torch_pool.pending[0][0], torch_pool.ready[0][0] = True, clock.mark(SimpleNamespace(cuda_stream=7))
    with pytest.raises(RuntimeError, match="built without the runtime"):
        torch_pool.before_read(0, 0)


def test_a_closed_clock_refuses_its_marks_and_closing_destroys_every_event(fake_cuda):
    rt = FakeRuntime()
    clock = Clock(torch.device("cuda"), rt=rt)
    clock.reserve_events(3)
    a = clock.mark(fake_cuda)
    b = clock.mark(fake_cuda)
    t = clock.us(a)
    made = [c[1] for c in rt.calls if c[0] == "record"][:1] + [ev for ev in range(101, 101 + rt.made)]
    rt.fail_destroy.add(102)                                       # one destroy fails: the rest still go
    rt.take()
    with pytest.raises(RuntimeError, match="event 102"):
        clock.close()
    assert sorted(c[1] for c in rt.take()) == sorted(set(made))
    clock.close()                                                  # twice: nothing
    assert rt.take() == []
    assert clock.us(a) == t                                        # read before: kept
    for use in (lambda: clock.us(b), lambda: clock.mark(fake_cuda), lambda: clock.done(b), lambda: clock.wait(b),
                lambda: clock.reserve_events(1)):
        with pytest.raises(RuntimeError, match="destroyed"):
            use()
    assert rt.take() == []


def test_a_run_sizes_its_events_by_what_its_layers_can_mark():
    from cmoe.executor.run import _reserve
    from cmoe.executor.streams import marks_per_layer
    assert marks_per_layer(1, 2, 8) == 11 and marks_per_layer(8, 2, 8) == 23 and marks_per_layer(8, 1, 8) == 23
    asked = []
    w = SimpleNamespace(spec=SimpleNamespace(num_experts=8, top_k=2))
    cfg = SimpleNamespace(batch=1)
    for each_pass, want in ((False, 2 + 32 * 23 + 256 * (2 + 32 * 11)), (True, 2 + 32 * 23 + (2 + 32 * 11))):
        eng = SimpleNamespace(M=32, spans_each_pass=each_pass, clock=SimpleNamespace(reserve_events=asked.append))
        _reserve(eng, w, cfg, 257)
        assert asked.pop() == want
    from cmoe.executor.streams import RESERVE_MAX, run_events
    assert run_events(257, 26, 64, 8, 8, False) == RESERVE_MAX     # many experts: capped, the rest made late


def test_a_run_that_raises_still_destroys_its_events():
    from cmoe.executor.engine import Engine
    done = []

    def settle():
        done.append("settle")
        raise RuntimeError("settle broke")

    eng = SimpleNamespace(cuda=False, pool=SimpleNamespace(settle=settle),
                          clock=SimpleNamespace(close=lambda: done.append("close")))
    with pytest.raises(RuntimeError, match="settle broke"):
        Engine.release(eng)
    assert done == ["settle", "close"]
