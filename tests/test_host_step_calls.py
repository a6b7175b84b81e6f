"""The lean engine's host step on CUDA, its runtime calls checked on the CPU with the stand-in
runtime of test_host_calls.py: what a layer's read-back and a load ask of the runtime and of
torch, pass after pass. Whole runs through the runtime on a GPU: test_host_calls_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cmoe.executor.cuda_rt import D2H, DISABLE_TIMING, H2D
from cmoe.executor.lean_io import HostIO
from tests.test_host_calls import FakeRuntime, _TorchEvent, fake_cuda  # noqa: F401 (a fixture)

ANY = type("Any", (), {"__eq__": lambda self, other: True, "__repr__": lambda self: "ANY"})()


def _engine(rt, rb):
    eng = SimpleNamespace(cuda=True, t={"rb": [rb]}, _rb_pin=[None], pool=SimpleNamespace(compute_h=7),
                          cs="compute stream",
                          clock=SimpleNamespace(rt=rt, order_event=lambda: rt.event(DISABLE_TIMING)))
    eng._rb_entry = lambda rb, got: HostIO._rb_entry(eng, rb, got)
    eng._rb_queue = lambda got: HostIO._rb_queue(eng, got)
    return eng


def test_commits_layer0_prediction_reads_back_like_a_layer(monkeypatch):
    """commit's layer-0 prediction (`t["rb0"]`) at a decode pass's start: the runtime's copy into
    its own pinned buffer and its event, the same three calls a layer's read-back makes, the
    buffer kept from pass to pass; none where the pass has no such buffer."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))   # no CUDA here
    rt = FakeRuntime()
    rb0 = torch.tensor([[3.0, 5.0, 0.75, 0.25]])
    eng = _engine(rt, rb0)
    eng.t["rb0"], eng._rb_pin0 = rb0, None
    started = HostIO._read_back_pred0(eng)
    pin, ev = eng._rb_pin0[0], eng._rb_pin0[1]
    assert rt.take() == [("event", DISABLE_TIMING), ("copy", pin.data_ptr(), rb0.data_ptr(), 16, D2H, 7), ("record", ev, 7)]
    pin[:] = rb0                                          # what the device's copy would have written
    assert HostIO._read_back_wait(eng, started).tolist() == [[3.0, 5.0, 0.75, 0.25]] and rt.take() == [("sync", ev)]
    HostIO._read_back_pred0(eng)
    assert eng._rb_pin0[0] is pin and rt.take() == [("copy", pin.data_ptr(), rb0.data_ptr(), 16, D2H, 7), ("record", ev, 7)]
    del eng.t["rb0"]
    assert HostIO._read_back_pred0(eng) is None and rt.take() == []


def test_a_layers_read_back_asks_torch_once_per_buffer(monkeypatch):
    """The read-back of one layer, pass after pass: its copy and its own event's record, then the
    wait; torch is asked for the addresses once per source tensor (a graph's is the same every
    pass), the pinned buffer and event are kept for a new tensor of the same shape, and a new
    shape takes a new buffer with the same event."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))   # no CUDA here
    asked = []
    data_ptr = torch.Tensor.data_ptr
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: asked.append(1) or data_ptr(self))
    rt = FakeRuntime()
    rb = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    eng = _engine(rt, rb)
    started = HostIO._read_back_start(eng, 0)
    pin, ev = eng._rb_pin[0][0], eng._rb_pin[0][1]
    assert rt.take() == [("event", DISABLE_TIMING), ("copy", data_ptr(pin), data_ptr(rb), 48, D2H, 7), ("record", ev, 7)]
    host = HostIO._read_back_wait(eng, started)
    assert rt.take() == [("sync", ev)] and len(asked) == 2
    pin[:] = rb                                           # what the device's copy would have written
    for _ in range(3):                                    # the next passes: no torch call, the same view
        again = HostIO._read_back_wait(eng, HostIO._read_back_start(eng, 0))
        assert again is host and again.tolist() == rb.tolist()
        assert rt.take() == [("copy", data_ptr(pin), data_ptr(rb), 48, D2H, 7), ("record", ev, 7), ("sync", ev)]
    assert len(asked) == 2
    eng.t["rb"][0] = rb2 = rb + 1                         # a new tensor, the same shape: buffer and event kept
    HostIO._read_back_start(eng, 0)
    assert eng._rb_pin[0][0] is pin and rt.take() == [("copy", data_ptr(pin), data_ptr(rb2), 48, D2H, 7),
                                                     ("record", ev, 7)]
    eng.t["rb"][0] = rb3 = torch.zeros(1, 6)               # a new shape: a new buffer, the same event
    HostIO._read_back_start(eng, 0)
    pin3 = eng._rb_pin[0][0]
    assert pin3 is not pin and pin3.shape == rb3.shape and eng._rb_pin[0][1] == ev
    assert rt.take() == [("copy", data_ptr(pin3), data_ptr(rb3), 24, D2H, 7), ("record", ev, 7)]


def test_a_read_back_without_the_runtime_goes_through_torch(fake_cuda, monkeypatch):  # noqa: F811
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    rb = torch.arange(6, dtype=torch.float32).reshape(1, 6)
    eng = _engine(None, rb)
    for _ in range(2):
        host = HostIO._read_back_wait(eng, HostIO._read_back_start(eng, 0))
        ev = _TorchEvent.made[-1]
        assert host.tolist() == rb.tolist() and ev.recorded == ["compute stream"] and ev.synced == 1
        assert eng._rb_pin[0][1] is None and eng._rb_pin[0][3] is None
    assert len(_TorchEvent.made) == 2


def test_a_load_takes_the_stores_row_once_and_three_runtime_calls(fake_cuda, monkeypatch):  # noqa: F811
    """Engine._load on the runtime: the store's row of an expert is looked up the first time it is
    loaded and kept; each load of a slot no kernel has read is its start mark, the copy and its end
    mark on the copy stream (a read slot's wait first: tests/test_host_calls.py), and its span."""
    from cmoe.executor.engine import Engine
    from cmoe.executor.records import RunLog
    from cmoe.executor.streams import Clock
    from cmoe.policy.policies import Load
    from tests.test_host_calls import _fake_pool
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    rt = FakeRuntime()
    clock = Clock(torch.device("cuda"), rt=rt)
    clock.reserve_events(8)
    rows = torch.arange(3 * 6, dtype=torch.uint8).reshape(3, 6)
    looked = []
    eng = SimpleNamespace(_srcs={}, _landed={}, _pending=[], log=RunLog(), clock=clock, pool=_fake_pool(rt),
                          cur=SimpleNamespace(index=4), spec=SimpleNamespace(moe_layers=[1]),
                          store=SimpleNamespace(expert=lambda m, e: looked.append((m, e)) or rows[e]))
    eng._span = lambda *a: Engine._span(eng, *a)
    rt.take()
    for slot in (1, 0, 1):
        Engine._load(eng, Load(0, 2, slot, None, "demand"))
        t0, t1 = eng._pending[-1][5:7]
        assert rt.take() == [("record", t0.ev, 11), ("copy", 1000 * (slot + 1), rows[2].data_ptr(), 4, H2D, 11),
                             ("record", t1.ev, 11)]
        assert eng._pending[-1] == (4, 1, "copy0", "load", 2, t0, t1, 4) and eng._landed[(0, 2)] is t1
    assert looked == [(0, 2)] and eng._srcs[(0, 2)].data_ptr() == rows[2].data_ptr()
    assert (eng.log.at(4).loads, eng.log.at(4).bytes_moved) == (3, 12)


def test_a_pass_lists_its_real_rows_once():
    """`_live`, asked by every layer's step: listed once per pass, again for the next pass."""
    from cmoe.executor.routes import Routes
    eng = Routes()
    eng.cur = SimpleNamespace(active=np.array([True, False, True]))
    first = eng._live()
    assert first == [0, 2] and eng._live() is first
    eng.cur = SimpleNamespace(active=np.array([False, True, True]))
    assert eng._live() == [1, 2]


def test_the_caches_step_on_the_device_writes_what_its_step_writes():
    """`StaticKV.device_step` (P's graph's first work) after `aim_device_steps`, with the host's
    `advance`: pass by pass the slot, the mask and the count that `step` leaves; a cache whose
    device and host counts part is refused at the end; with no prefill the first step is slot 0."""
    from cmoe.executor.kv import StaticKV
    a, b = StaticKV(2, 9, torch.device("cpu")), StaticKV(2, 9, torch.device("cpu"))
    for kv in (a, b):
        kv.prefill(4, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    b.aim_decode()                                     # the warm-up's aim, as `_capture` leaves it
    b.aim_device_steps()
    assert b.slots.item() == 3 and b.decoding
    for s in (4, 5, 6):
        assert a.step() == s == b.advance()
        b.device_step()
        assert a.slots.item() == b.slots.item() == s and a.length == b.length == s + 1
        assert torch.equal(a.valid, b.valid) and b.valid[:, s].all() and not b.valid[:, s + 1:].any()
    assert a.valid[0].tolist() == [False] + [True] * 6 + [False] * 2
    b.check_device_steps()
    b.advance()                                        # a pass that took a slot and never replayed P
    with pytest.raises(RuntimeError, match=r"on the device \(6\) is not the last one the host took \(7\)"):
        b.check_device_steps()
    c = StaticKV(1, 4, torch.device("cpu"))            # no prefill: the first step lands on slot 0
    c.aim_device_steps()
    assert c.advance() == 0
    c.device_step()
    assert c.slots.item() == 0 and c.valid.tolist() == [[True, False, False, False]]
    c.check_device_steps()


def test_a_graphed_passs_inputs_are_runtime_calls_and_torchs_ops_where_they_must(monkeypatch):
    """`pass_inputs`: with the runtime and device tensors, the cache's next slot (8 bytes from a
    pinned table of positions, made once per cache), its mask column (one 2-D memset) and each pair device
    to device, all on the compute stream, pass after pass; the cache's state as `step` leaves it.
    Without the runtime or the table, torch's ops do the same; a pair that is not two like device
    tensors, torch's copy alone."""
    from cmoe.executor import lean_io
    from cmoe.executor.cuda_rt import D2D
    from cmoe.executor.kv import StaticKV
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))   # no CUDA here
    monkeypatch.setattr(lean_io, "_on_device", lambda t: True)
    rt = FakeRuntime()
    rt.memset2d = lambda *a: rt.calls.append(("memset2d", *a))
    kv = StaticKV(3, 16, torch.device("cpu"))
    kv.prefill(5, None)
    dst, src = torch.zeros(3, 1, dtype=torch.long), torch.tensor([[7], [8], [9]])
    table = lean_io.slot_table(kv)
    for s in (5, 6):
        assert lean_io.pass_inputs(rt, kv, [(dst, src)], 7, table) is None
        assert rt.take() == [("copy", kv.slots.data_ptr(), table.data_ptr() + 8 * s, 8, H2D, 7),
                             ("memset2d", kv.valid.data_ptr() + s, 16, 1, 1, 3, 7),
                             ("copy", dst.data_ptr(), src.data_ptr(), 24, D2D, 7)]
        assert kv.length == s + 1 and kv.decoding and table.tolist() == list(range(16))
    assert kv.slots.item() == 0 and not kv.valid[:, 5:].any()          # the fake runtime wrote nothing
    # a pair of another dtype (a recorded trace's int32 ids): torch's copy for it, the runtime's for the rest
    kv = StaticKV(3, 16, torch.device("cpu"))
    kv.prefill(5, None)
    other, dst2 = torch.zeros(3, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    lean_io.pass_inputs(rt, kv, [(other, src.int()), (dst2, torch.tensor([4, 5]))], 7, table)
    assert rt.take() == [("copy", kv.slots.data_ptr(), table.data_ptr() + 40, 8, H2D, 7),
                         ("memset2d", kv.valid.data_ptr() + 5, 16, 1, 1, 3, 7),
                         ("copy", dst2.data_ptr(), ANY, 16, D2D, 7)]
    assert other.tolist() == [[7], [8], [9]] and dst2.tolist() == [0, 0] and kv.length == 6
    # no runtime, or no table: torch's ops for everything, as `step` and `copy_` do
    for no_rt, no_table in ((None, table), (rt, None)):
        kv = StaticKV(3, 16, torch.device("cpu"))
        kv.prefill(5, None)
        dst.zero_()
        lean_io.pass_inputs(no_rt, kv, [(dst, src)], 7, no_table)
        assert rt.take() == [] and dst.tolist() == [[7], [8], [9]] and kv.length == 6
        assert kv.slots.item() == 5 and kv.valid[:, 5].all() and not kv.valid[:, 6:].any()
    # stepped (P's graph moves the slot and column on the device): the host's count alone, the pairs as before
    kv = StaticKV(3, 16, torch.device("cpu"))
    kv.prefill(5, None)
    for stepped_rt in (rt, None):
        dst.zero_()
        lean_io.pass_inputs(stepped_rt, kv, [(dst, src)], 7, None, stepped=True)
        assert rt.take() == ([("copy", dst.data_ptr(), src.data_ptr(), 24, D2D, 7)] if stepped_rt else [])
        assert dst.tolist() == ([[0], [0], [0]] if stepped_rt else [[7], [8], [9]])
    assert kv.length == 7 and kv.decoding and kv.slots.item() == 0 and not kv.valid[:, 5:].any()
    # the table: every position; none for a mask the runtime's memset would not write right
    assert lean_io.slot_table(StaticKV(1, 4, torch.device("cpu"))).tolist() == [0, 1, 2, 3]
    odd = StaticKV(2, 4, torch.device("cpu"))
    odd.valid = odd.valid.t().contiguous().t()
    assert lean_io.slot_table(odd) is None


def test_the_host_profile_counts_layers_or_passes(monkeypatch):
    """`_tick`: time since the last tick into the named phase; a read-back wait counts a layer (the
    Python step's profile), the head a pass (`CMOE_HOST_PROFILE=pass`, the program running); with
    no profile, nothing."""
    from cmoe.executor import lean_steps
    clock = iter([1.0, 1.000010, 1.000025, 1.000030, 1.000100, 1.000130])
    monkeypatch.setattr(lean_steps.time, "perf_counter", lambda: next(clock))
    eng = type("Eng", (lean_steps.HostSteps,), {})()
    eng.host_phases, eng._t_phase = {}, 0.0
    eng._tick(None)
    for phase in ("pass: inputs", "pass: program (its layers)", "pass: head", "read-back wait", "pass: head"):
        eng._tick(phase)
    got = {k: round(v, 3) if isinstance(v, float) else v for k, v in eng.host_phases.items()}
    assert got == {"pass: inputs": 10.0, "pass: program (its layers)": 15.0, "pass: head": 35.0,
                   "read-back wait": 70.0, "passes": 2, "layers": 1}
    eng.host_phases = None
    eng._tick("pass: head")                                        # off: no clock read, nothing kept
    assert eng.host_phases is None


def test_the_pass_profile_keeps_the_graphed_passes_alone(monkeypatch):
    """`_hp_setup` (right after the graphs' capture) drops what the prefill's Python step timed when
    `CMOE_HOST_PROFILE=pass`; with `=1` the whole run's phases stay."""
    from cmoe.executor.lean_fast import HostProgramSteps
    for mode, kept in (("pass", {}), ("1", {"read-back wait": 5.0, "layers": 1})):
        monkeypatch.setenv("CMOE_HOST_PROFILE", mode)
        eng = type("Eng", (HostProgramSteps,), {"_hp_allowed": lambda self: False})()
        eng.host_phases = {"read-back wait": 5.0, "layers": 1}
        eng._hp_setup()
        assert eng.host_phases == kept and eng._hp is None
