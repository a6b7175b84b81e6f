"""The host's route step after a long wait (`cmoe.calibrate.wake`, `HardwareProfile.host_wake`):
the factor's table read exactly, checked where a profile is made, fitted from calibration's
samples, and applied alike by both simulator engines to the route step."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from cmoe.calibrate.host_fit import host_fields as _host_fields
from cmoe.calibrate.wake import fit_wake, pass_start_samples, route_and_wait
from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, HardwareProfile
from tests.test_replay import FLAT_FIFO, LEAN, both, same_run, tiny, tiny_costs, trace_of

POINTS = ((100.0, 1.0), (1100.0, 2.0), (3100.0, 2.5))


def test_the_factor_is_the_table_held_flat_outside_it():
    p = replace(H200, host_wake_points=POINTS, host_route_waits=((1, 100.0), (8, 600.0)))
    assert [p.host_wake(w) for w in (0.0, 100.0, 600.0, 1100.0, 2100.0, 3100.0, 9000.0)] == \
        [1.0, 1.0, 1.5, 2.0, 2.25, 2.5, 2.5]
    # the factor each batch's route point holds already: its calibration runs' own wait
    assert [p.host_wake_base(t) for t in (1, 8, 16)] == [1.0, 1.5, 1.5]
    assert H200.host_wake(5000.0) == 1.0 and H200.host_wake_base(8) == 1.0     # none measured
    assert replace(H200, host_wake_points=POINTS).host_wake_base(8) == 1.0
    back = HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.host_wake_points == POINTS and back == p
    # a JSON null is "none measured" for a table, and still refused for a curve the model needs
    assert HardwareProfile.from_dict(H200.to_dict() | {"host_wake_points": None}).host_wake_points == ()
    with pytest.raises(CmoeError, match="h2d_pinned is"):
        HardwareProfile.from_dict(H200.to_dict() | {"h2d_pinned": None})


@pytest.mark.parametrize("table,pts,says", [
    ("host_wake_points", [[1100.0, 2.0], [100.0, 1.0]], "waits ascending"),
    ("host_wake_points", [[100.0, 0.0]], "a factor > 0"),
    ("host_wake_points", [[-5.0, 1.0]], "a wait >= 0"),
    ("host_wake_points", [[100.0, "fast"]], "host_wake_points point"),
    # the pass start after a long pass (`host_pass_start_points`, tests/test_pass_wake.py)
    ("host_pass_start_points", [[15000.0, 27.0], [5000.0, 0.0]], "passes ascending"),
    ("host_pass_start_points", [[5000.0, -1.0]], "extra us >= 0"),
    ("host_pass_start_points", [[-5.0, 1.0]], "a pass >= 0"),
])
def test_a_bad_table_is_one_line_naming_it(table, pts, says):
    with pytest.raises(CmoeError, match=table) as e:
        HardwareProfile.from_dict(H200.to_dict() | {table: pts})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_fitting_divides_by_the_unled_runs_and_drops_a_wait_that_did_not_grow():
    samples = [(0.0, 10e-6, 100e-6), (300.0, 13.2e-6, 400e-6), (1000.0, 16.5e-6, 1.1e-3), (3000.0, 30e-6, 100e-6),
               (0.0, 12e-6, 120e-6), (300.0, 13.2e-6, 400e-6), (1000.0, 16.5e-6, 1.1e-3), (3000.0, 30e-6, 120e-6)]
    got = fit_wake(samples)
    assert [w for w, _ in got] == pytest.approx([110e-6, 400e-6, 1.1e-3])
    assert [f for _, f in got] == pytest.approx([1.0, 1.2, 1.5])
    # the 3 ms lead's runs waited no longer than the unled ones (110 us): dropped, each point kept
    # only past the one before; a run with no route step, or no unled run, gives nothing to divide by
    assert fit_wake([(300.0, 13e-6, 400e-6)]) == [] and fit_wake([(0.0, 0.0, 1e-4)]) == []
    # into the profile's units: us and the factor
    h = {"layer_points": [(1, 1e-5)], "route_points": [(1, 1e-5)], "expert_points": [(1, 1e-5)], "sync_s": 0.0,
         "pass_start_s": 0.0, "head_s": 0.0, "wake_points": [[110e-6, 1.0], [400e-6, 1.2]]}
    got = _host_fields(h)["host_wake_points"]
    assert [w for w, _ in got] == pytest.approx([110.0, 400.0]) and [f for _, f in got] == [1.0, 1.2]


def test_the_route_step_and_wait_come_from_the_decode_passes_spans():
    # (source, step, layer, stream, op, expert, start, end, bytes); pass 0 is a prefill
    spans = [("x", 0, 0, "host", "host_route", -1, 0.0, 500.0, 0),
             ("x", 1, 0, "host", "host_route", -1, 0.0, 10.0, 0), ("x", 1, 1, "host", "host_route", -1, 0.0, 20.0, 0),
             ("x", 1, 0, "host", "host_sync", -1, 0.0, 100.0, 0), ("x", 1, 1, "host", "host_sync", -1, 0.0, 300.0, 0),
             ("x", 2, 0, "host", "host_sync", -1, 0.0, 200.0, 0)]
    log = SimpleNamespace(pass_us=[(0, False, 4, 1.0), (1, True, 1, 1.0), (2, True, 1, 1.0)], spans=spans)
    assert route_and_wait(log) == pytest.approx((15e-6, 200e-6))
    assert route_and_wait(SimpleNamespace(pass_us=[(0, False, 4, 1.0)], spans=spans)) == (0.0, 0.0)


def test_a_pass_starts_samples_pair_each_pass_with_the_one_before():
    """[previous pass's latency, gap from its host_head, gap from the later of that and its GPU end,
    layer 0's host_attention excess over the others, its host_head], us; the prefill (pass 0) is no one's."""
    h = lambda p, l, op, a, b: ("x", p, l, "host", op, -1, a, b, 0)        # noqa: E731
    g = lambda p, l, a, b: ("x", p, l, "compute", "attention", -1, a, b, 0)  # noqa: E731
    spans = [h(0, 0, "host_head", 0.0, 5.0),
             h(1, 0, "host_attention", 20.0, 50.0), h(1, 1, "host_attention", 60.0, 70.0), h(1, 2, "host_attention", 80.0, 90.0),
             g(1, 0, 30.0, 100.0), g(1, 1, 100.0, 400.0), h(1, 2, "host_head", 95.0, 120.0),
             h(2, 0, "host_attention", 450.0, 500.0), h(2, 1, "host_attention", 510.0, 520.0),
             g(2, 1, 500.0, 600.0), h(2, 1, "host_head", 530.0, 540.0),
             h(3, 0, "host_attention", 560.0, 561.0)]                      # one layer: no excess to read
    log = SimpleNamespace(pass_us=[(0, False, 4, 9.0), (1, True, 1, 380.0), (2, True, 1, 150.0), (3, True, 1, 10.0)],
                          spans=spans)
    # pass 1 -> 2: head ends at 120, the GPU at 400, pass 2 enters at 450: gaps 330 and 50; excess 50 - 10
    log.spans.append(("x", 1, 1, "copy0", "load", 3, 110.0, 130.0, 1))     # pass 1's loads: the last column
    log.spans.append(("x", 2, 0, "copy0", "load", 4, 455.0, 470.0, 1))
    # no read-back: no wait; pass 2's host speed past its first layer: layer 1's 10 us
    assert pass_start_samples(log) == [[380.0, 330.0, 50.0, 40.0, 25.0, 1.0, 0.0, 10.0]]
    # a prefill between two decode passes (another request's): no pair across it
    log.pass_us[2] = (2, False, 4, 150.0)
    assert pass_start_samples(log) == []


def test_the_wait_is_the_gpu_ahead_of_the_host_at_the_read_back():
    """A host that costs nothing but its 1 us route step: it waits at every read-back from the end
    of its last route step (a route span's end) to the end of the layer's attention on the GPU
    (the attention span's end), and the route span is then 1 us times f(that wait) = 1 + wait / 10
    up to 20 us, in both engines; at batch 2 over the factor its route point held (a wait of 5 us:
    f = 1.5)."""
    t = tiny(M=3, E=4, T=24, seed=2, requests=2, K=2)
    prof = replace(FLAT_FIFO, host_layer_us=0.0, host_expert_us=0.0, host_wake_points=((0.0, 1.0), (20.0, 3.0)))
    for batch, held in ((1, ()), (2, ((1, 0.0), (2, 5.0)))):
        a, b, _, _ = both(t, "ondemand", replace(prof, host_route_waits=held), batch, slots=4, costs=tiny_costs(t))
        same_run(a, b)
        route = {(s[1], s[2]): s for s in a.spans if s[4] == "route"}
        att = {(s[1], s[2]): s[7] for s in a.spans if s[4] == "attention"}
        base = 1.5 if held else 1.0
        checked = 0
        for (p, d), s in route.items():
            if d == 0:
                continue
            wait = att[(p, d)] - route[(p, d - 1)][7]
            assert wait > 0
            assert s[7] - s[6] == pytest.approx(1.0 + 1.0 * (min(1 + wait / 10, 3.0) / base - 1.0), abs=1e-9)
            checked += 1
        assert checked >= 20


def test_both_engines_scale_the_route_step_not_its_loads():
    """FLAT_FIFO's host is slower than its GPU, so every layer's read-back finds the GPU done (a
    wait of 0) and its route span is the host's route step alone: 1 us, and 3 us with a factor of 3
    at every wait, in SimPy and the replay alike; upper, silent in LEAN, has no step to scale."""
    t = tiny(M=3, E=4, T=24, seed=1, requests=2, K=2)
    spans = {}
    for k in (1.0, 3.0):
        prof = replace(FLAT_FIFO, host_wake_points=((0.0, k),)) if k != 1.0 else FLAT_FIFO
        a, b, _, _ = both(t, "ondemand", prof, 1, slots=4, costs=tiny_costs(t))
        same_run(a, b)
        spans[k] = [s[7] - s[6] for s in a.spans if s[4] == "route"]
    assert spans[1.0] and set(spans[1.0]) == {1.0} and spans[3.0] == [3.0] * len(spans[1.0])
    loads = replace(FLAT_FIFO, host_load_us=0.5)
    a, b, _, _ = both(t, "ondemand", replace(loads, host_wake_points=((0.0, 2.0),)), 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    base, _, _, _ = both(t, "ondemand", loads, 1, slots=2, costs=tiny_costs(t))
    # a load's own host cost is calibrated in a run that loads (long waits already): not scaled, so
    # a route span with loads grows by the route step's 1 us only
    woken = [s[7] - s[6] for s in a.spans if s[4] == "route"]
    plain = [s[7] - s[6] for s in base.spans if s[4] == "route"]
    assert woken == [u + 1.0 for u in plain] and max(plain) > 1.0
    tr = trace_of("mixtral-8x7b", requests=1, decode=8)
    up, _, _, _ = both(tr, "upper", replace(LEAN, host_wake_points=((0.0, 5.0),)), 1)
    plain, _, _, _ = both(tr, "upper", LEAN, 1)
    assert up.pass_us == plain.pass_us


def test_calibrate_fits_the_samples_into_the_profile_and_shows_them_beside_it():
    """Measurements with wake samples (as `cmoe.calibrate.wake.measure` writes them) fit into the
    profile's `host_wake_points` in us, and `beside` puts each lead's mean route step next to the
    profile's route step at one token times its factor; measurements without them (a CPU's) leave
    the factor at 1."""
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import fit_profile
    from tests.test_calibrate import _synthetic
    known = replace(H200, host_route_us=20.0)
    samples = [[0.0, 20e-6, 100e-6], [1000.0, 30e-6, 1100e-6], [0.0, 20e-6, 100e-6], [1000.0, 30e-6, 1100e-6]]
    m = _synthetic(known)
    plain = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-03")
    assert plain.host_wake_points == () and plain.host_wake(5000.0) == 1.0
    m["layer"]["host"] |= {"wake_points": fit_wake([tuple(x) for x in samples]), "wake_samples": samples,
                           "route_waits": [(1, 100e-6), (8, 350e-6)]}
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-03")
    assert [w for w, _ in got.host_wake_points] == pytest.approx([100.0, 1100.0])
    assert [f for _, f in got.host_wake_points] == pytest.approx([1.0, 1.5])
    assert [t for t, _ in got.host_route_waits] == [1, 8] and got.host_wake_base(8) == pytest.approx(1.125)
    rows = {line[:28].strip(): line[28:].split() for line in beside(got, m).splitlines()}
    assert rows["host, route after 100us"][:2] == ["20.0us", f"{got.host_route(1):.1f}us"]
    assert rows["host, route after 1100us"][:2] == ["30.0us", f"{got.host_route(1) * 1.5:.1f}us"]


@pytest.mark.parametrize("pts,says", [
    ([[1100.0, 200.0], [100.0, 0.0]], "idles ascending"),
    ([[100.0, -1.0]], "extra us >= 0"),
    ([[-5.0, 1.0]], "an idle >= 0"),
])
def test_a_bad_cpu_wake_table_is_one_line_naming_it(pts, says):
    """`cpu_wake_points` (idle us, extra us): an extra of 0 is allowed (the back-to-back experts')."""
    with pytest.raises(CmoeError, match="cpu_wake_points") as e:
        HardwareProfile.from_dict(H200.to_dict() | {"cpu_wake_points": pts})
    assert says in str(e.value) and "\n" not in str(e.value)
    ok = HardwareProfile.from_dict(H200.to_dict() | {"cpu_wake_points": [[25.0, 0.0], [600.0, 300.0]]})
    assert ok.cpu_wake_points == ((25.0, 0.0), (600.0, 300.0)) and ok.cpu_wake_us(312.5) == pytest.approx(150.0)
