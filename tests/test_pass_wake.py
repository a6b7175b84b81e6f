"""The host's pass start after a long decode pass (`host_pass_start_points`,
`HardwareProfile.pass_start_extra_us`, `cmoe.calibrate.wake.fit_pass_start`): the table read
exactly (a bad one refused: tests/test_host_wake.py, beside the other wait tables), fitted from
calibration's led runs, and added alike by both simulator engines to the pass start that
`host_pass_start_us` prices."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from cmoe.calibrate.host_fit import host_fields
from cmoe.calibrate.wake import fit_pass_start, pass_start_means
from cmoe.core.hw import H200, HardwareProfile
from tests.test_replay import FLAT_CPU_START, FLAT_FIFO, both, same_run, tiny, tiny_costs

POINTS = ((5000.0, 0.0), (15000.0, 27.0), (105000.0, 160.0))


def test_the_extra_is_the_table_held_flat_outside_it():
    p = replace(H200, host_pass_start_points=POINTS)
    assert [p.pass_start_extra_us(u) for u in (0.0, 5000.0, 10000.0, 15000.0, 60000.0, 105000.0, 9e6)] == \
        [0.0, 0.0, 13.5, 27.0, 93.5, 160.0, 160.0]
    assert H200.pass_start_extra_us(9e6) == 0.0                              # none measured
    # host time: a host twice as slow (`host_scaled`, validate_table's --host-adjust) takes twice the extra
    assert p.host_scaled(2.0).host_pass_start_points == ((5000.0, 0.0), (15000.0, 54.0), (105000.0, 320.0))
    back = HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.host_pass_start_points == POINTS and back == p
    assert HardwareProfile.from_dict(H200.to_dict() | {"host_pass_start_points": None}).host_pass_start_points == ()


def _pairs(prev, gap, gpu_gap, excess, n=5):
    return [[prev, gap, gpu_gap, excess]] * n


def test_the_fit_is_each_leads_start_over_the_unled_runs():
    """A queued (unled) pair's start is its gap from the host's head plus layer 0's excess (its
    gap from the GPU's end is negative: the host went on before the GPU ended); a synced (led)
    pair's is its gap from the GPU's end plus the excess. Per lead the runs' medians are averaged;
    a lead whose passes grew no longer than the point before is dropped."""
    starts = [[0.0, _pairs(5000.0, 30.0, -170.0, 70.0)], [300.0, _pairs(15000.0, 540.0, 40.0, 90.0)],
              [1000.0, _pairs(39000.0, 1300.0, 80.0, 110.0)], [3000.0, _pairs(39000.0, 3300.0, 300.0, 100.0)],
              [0.0, _pairs(5200.0, 40.0, -160.0, 70.0)], [300.0, _pairs(15400.0, 540.0, 50.0, 90.0)],
              [1000.0, _pairs(39000.0, 1300.0, 100.0, 110.0)], [3000.0, []]]
    means = pass_start_means(starts)
    assert means == {0.0: (5100.0, 105.0), 300.0: (15200.0, 135.0), 1000.0: (39000.0, 200.0), 3000.0: (39000.0, 400.0)}
    assert fit_pass_start(starts) == [[5100.0, 0.0], [15200.0, 30.0], [39000.0, 95.0]]
    # a lead that started sooner than the unled runs adds 0, never less; no unled runs, no table
    assert fit_pass_start([[0.0, _pairs(5000.0, 30.0, -1.0, 70.0)], [300.0, _pairs(9000.0, 0.0, 10.0, 50.0)]]) == \
        [[5000.0, 0.0], [9000.0, 0.0]]
    assert fit_pass_start(starts[1:4]) == [] and fit_pass_start([]) == []
    h = {"layer_points": [(1, 1e-5)], "route_points": [(1, 1e-5)], "expert_points": [(1, 1e-5)], "sync_s": 0.0,
         "pass_start_s": 1e-4, "head_s": 0.0}
    assert "host_pass_start_points" not in host_fields(h)
    assert host_fields(h | {"pass_start_samples": starts})["host_pass_start_points"] == \
        ((5100.0, 0.0), (15200.0, 30.0), (39000.0, 95.0))


def test_a_pass_after_a_long_decode_pass_starts_later_in_both_engines():
    """FLAT_FIFO's host (12 us a layer) is slower than its GPU, so every pass runs at the host's
    pace and a pass start that takes x more makes its pass x longer. With the extra equal to the
    pass before's length (a table (0, 0), (1e6, 1e6)), each pass after a decode pass is longer by
    exactly that pass's length, and the first decode pass (after the prefill) by nothing, in SimPy
    and the replay alike; a CPU-expert policy's own pass start (`startup_after_host`) is not the
    one the table was measured on, and is left as it was."""
    t = tiny(M=3, E=4, T=24, seed=0, requests=2, K=2)
    prof = replace(FLAT_FIFO, host_pass_start_us=5.0)
    for policy, slots in (("upper", 4), ("ondemand", 2)):
        a, b, _, _ = both(t, policy, replace(prof, host_pass_start_points=((0.0, 0.0), (1e6, 1e6))), 1, slots=slots,
                          costs=tiny_costs(t))
        c, d, _, _ = both(t, policy, prof, 1, slots=slots, costs=tiny_costs(t))
        same_run(a, b)
        same_run(c, d)
        dec = [x[1] for x in a.pass_us]
        assert dec[0] is False and dec.count(True) >= 20
        grew = [w[3] - o[3] for w, o in zip(a.pass_us, c.pass_us)]
        assert grew == [a.pass_us[i - 1][3] if i and dec[i - 1] else 0.0 for i in range(len(grew))]
    cpu = replace(FLAT_CPU_START, host_pass_start_points=((0.0, 0.0), (1e6, 1e6)))
    assert cpu.startup_after_host(True)
    a, b, _, _ = both(t, "lfu-fallback", cpu, 1, slots=2, costs=tiny_costs(t))
    c, _, _, _ = both(t, "lfu-fallback", FLAT_CPU_START, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    assert a.pass_us == c.pass_us


def test_calibrate_fits_the_samples_and_shows_each_lead_beside_the_profile():
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import fit_profile
    from tests.test_calibrate import _synthetic
    known = replace(H200, host_pass_start_us=100.0)
    m = _synthetic(known)
    plain = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-06")
    assert plain.host_pass_start_points == () and "host_pass_start_points" not in plain.sources
    starts = [[0.0, _pairs(5000.0, 30.0, -170.0, 70.0)], [1000.0, _pairs(39000.0, 1300.0, 80.0, 110.0)]]
    m["layer"]["host"] |= {"pass_start_samples": starts}
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-06")
    assert got.host_pass_start_points == ((5000.0, 0.0), (39000.0, 90.0))
    assert "GPU sleep" in got.sources["host_pass_start_points"]
    rows = {line[:28].strip(): line[28:].split() for line in beside(got, m).splitlines()}
    assert rows["host, pass start after 5ms"][:2] == ["100.0us", f"{got.host_pass_start_us:.1f}us"]
    assert rows["host, pass start after 39ms"][:2] == ["190.0us", f"{got.host_pass_start_us + 90.0:.1f}us"]


def test_a_loading_runs_boundary_without_its_wait_is_shown_not_fitted():
    """calibrate's ondemand run with top_k slots (every layer loads) keeps its pass-start samples;
    `beside` shows its head, and its head and pass start, against what the profile prices; samples
    from before the forty-fifth session's last change carry no last wait, and the fit leaves them
    out (`test_a_loading_runs_boundary_is_fitted_at_its_last_wait` fits those that do)."""
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import fit_profile
    from cmoe.calibrate.wake import loading_boundary
    from tests.test_calibrate import _synthetic
    known = replace(H200, host_pass_start_us=100.0, host_head_us=40.0)
    m = _synthetic(known)
    pairs = [[40000.0, 500.0, -20.0, 150.0, 170.0, 60.0], [42000.0, 400.0, 30.0, 130.0, 150.0, 58.0],
             [38000.0, 450.0, 40.0, 110.0, 400.0, 64.0]]
    # the starts, the gap from the head plus the excess: 650, 530, 560; medians (the head's mean would be 240)
    assert loading_boundary(pairs)[:4] == (40000.0, 170.0, 560.0, 60.0)
    assert loading_boundary([p[:5] for p in pairs])[:3] == (40000.0, 170.0, 560.0)   # older samples: no loads
    assert loading_boundary([]) is None
    # with the GPU-sleep runs' samples the profile has an extra after a 40 ms pass, shown in the row
    m["layer"]["host"] |= {"pass_start_samples": [[0.0, _pairs(5000.0, 30.0, -170.0, 70.0)],
                                                  [1000.0, _pairs(39000.0, 1300.0, 80.0, 110.0)]]}
    plain = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-07")
    assert plain.pass_start_extra_us(40000.0) == 90.0
    m["layer"]["host"] |= {"loading_pass_start_samples": pairs}
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-07")
    assert got == plain
    rows = {line[:28].strip(): line[28:].split() for line in beside(got, m).splitlines()}
    assert rows["host, head, 60 loads"][:2] == ["170.0us", f"{got.host_head_us:.1f}us"]
    assert rows["host, head + start, loading"][:2] == ["820.0us", f"{got.host_head_us + got.host_pass_start_us + 90.0:.1f}us"]



LOADING = [[40000.0, 500.0, -20.0, 150.0, 170.0, 60.0, 3000.0], [42000.0, 400.0, 30.0, 130.0, 150.0, 58.0, 3400.0],
           [38000.0, 450.0, 40.0, 110.0, 400.0, 64.0, 2600.0]]      # head 170, start 560, last wait 3000 (medians);
# head plus start 820, 680, 960 (median 820)


def test_the_boundary_extra_is_read_down_the_route_steps_wake():
    """What the loading run's boundary took over the price (820 - 400 = 420 us) at its last wait
    (3,000 us), and at each shorter wait of the route step's wake that share of it its factor less
    one is of the loading wait's (factor 1 at 140 us: nothing; 19 at 400: 18/23.5 of it); a line from
    (0, 0) where no wake was measured, it did not slow or it has no point below the loading wait;
    nothing where the boundary took no longer, or the samples carry no wait."""
    from cmoe.calibrate.wake import fit_boundary, loading_boundary
    assert loading_boundary(LOADING)[:6] == (40000.0, 170.0, 560.0, 60.0, 3000.0, 820.0)
    lb = loading_boundary(LOADING)                        # each median by its name too
    assert (lb.prev_us, lb.head_us, lb.start_us, lb.loads, lb.wait_us, lb.total_us) == tuple(lb)[:6]
    assert math.isnan(lb.host_us)                         # samples from before the host speed was kept
    speeds = [2.5, 5.0, 2.4]                              # the next pass's host us a layer: the median 2.5
    assert loading_boundary([x + [v] for x, v in zip(LOADING, speeds)]) == (*tuple(lb)[:6], 2.5)
    wake = ((140.0, 1.0), (400.0, 19.0), (1000.0, 23.0), (5000.0, 26.0))
    # the wake read at 3,000 us: 23 + 3 * 2000 / 4000 = 24.5, so 23.5 over the loading wait's
    assert fit_boundary(LOADING, lambda prev: 400.0 if prev == 40000.0 else 0.0, wake) == \
        [[140.0, 0.0], [400.0, 420.0 * 18.0 / 23.5], [1000.0, 420.0 * 22.0 / 23.5], [3000.0, 420.0]]
    line = [[0.0, 0.0], [3000.0, 420.0]]
    assert fit_boundary(LOADING, lambda prev: 400.0, ()) == line
    assert fit_boundary(LOADING, lambda prev: 400.0, ((0.0, 1.0),)) == line
    assert fit_boundary(LOADING, lambda prev: 400.0, ((3500.0, 2.0), (9000.0, 3.0))) == line    # none below the wait
    assert fit_boundary(LOADING, lambda prev: 820.0, wake) == []
    assert fit_boundary([p[:6] for p in LOADING], lambda prev: 400.0, wake) == [] and fit_boundary([], len, wake) == []
    p = replace(H200, host_boundary_points=((140.0, 0.0), (400.0, 180.0), (3000.0, 330.0)))
    assert [p.boundary_extra_us(w) for w in (0.0, 140.0, 270.0, 400.0, 3000.0, 9e6)] == [0.0, 0.0, 90.0, 180.0, 330.0, 330.0]
    assert H200.boundary_extra_us(9e6) == 0.0
    # the price as the engines charge it: head, start and both extras (none of them for a CPU-expert start)
    q = replace(p, host_head_us=40.0, host_pass_start_us=100.0, host_pass_start_points=POINTS)
    assert q.boundary_price_us(15000.0, 270.0) == 40.0 + 100.0 + (27.0 + 90.0)
    assert q.pass_start_extras_us(15000.0, 270.0) == 27.0 + 90.0      # what Simulation adds to the start
    assert replace(q, cpu_pass_start_us=300.0).boundary_price_us(15000.0, 270.0, cpu_experts=True) == 40.0 + 300.0
    assert p.host_scaled(2.0).host_boundary_points == ((140.0, 0.0), (400.0, 360.0), (3000.0, 660.0))
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_a_loading_runs_boundary_is_fitted_at_its_last_wait():
    """calibrate's fit: the quiet price is the profile's head and pass start with its extra after a
    pass as long as the loading run's (90 us after 40 ms); what the loading boundary took more is
    `host_boundary_points`, named in the sources, and `beside` prices the loading row with it."""
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import fit_profile
    from tests.test_calibrate import _synthetic
    known = replace(H200, host_pass_start_us=100.0, host_head_us=40.0)
    m = _synthetic(known)
    m["layer"]["host"] |= {"pass_start_samples": [[0.0, _pairs(5000.0, 30.0, -170.0, 70.0)],
                                                  [1000.0, _pairs(39000.0, 1300.0, 80.0, 110.0)]],
                           "loading_pass_start_samples": LOADING}
    got = fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-07")
    quiet = got.host_head_us + got.host_pass_start_us + 90.0
    assert got.host_boundary_points == ((0.0, 0.0), (3000.0, 820.0 - quiet))
    assert "top_k slots" in got.sources["host_boundary_points"]
    rows = {line[:28].strip(): line[28:].split() for line in beside(got, m).splitlines()}
    assert rows["host, head + start, loading"][:2] == ["820.0us", "820.0us"]


def test_a_pass_after_a_long_last_wait_starts_later_in_both_engines():
    """A table that adds 7 us whatever the wait makes each pass after a decode pass exactly 7 us
    longer on FLAT_FIFO's host-paced runs (a policy that reads back), in SimPy and the replay alike;
    a CPU-expert policy's own pass start is left as it was. Read by the wait, a table changes the
    runs of a host that waits for loads, alike in both engines (and `test_replay`'s flat-boundary)."""
    t = tiny(M=3, E=4, T=24, seed=0, requests=2, K=2)
    prof = replace(FLAT_FIFO, host_pass_start_us=5.0)
    a, b, _, _ = both(t, "ondemand", replace(prof, host_boundary_points=((0.0, 7.0),)), 1, slots=2, costs=tiny_costs(t))
    c, _, _, _ = both(t, "ondemand", prof, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    dec = [x[1] for x in a.pass_us]
    assert [w[3] - o[3] for w, o in zip(a.pass_us, c.pass_us)] == [7.0 if i and dec[i - 1] else 0.0 for i in range(len(dec))]
    cpu = replace(FLAT_CPU_START, host_boundary_points=((0.0, 7.0),))
    a, b, _, _ = both(t, "lfu-fallback", cpu, 1, slots=2, costs=tiny_costs(t))
    c, _, _, _ = both(t, "lfu-fallback", FLAT_CPU_START, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    assert a.pass_us == c.pass_us
    slow = replace(FLAT_FIFO, h2d_pinned=((1, 0.05),))              # 20 us copies: the host waits for them
    a, b, _, _ = both(t, "ondemand", replace(slow, host_boundary_points=((0.0, 0.0), (100.0, 50.0))), 1, slots=2,
                      costs=tiny_costs(t))
    c, _, _, _ = both(t, "ondemand", slow, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    assert a.pass_us != c.pass_us
