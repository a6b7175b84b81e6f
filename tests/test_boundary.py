"""`cmoe.analysis.boundary`: each pair of decode passes' boundary read off a measured run's spans as
calibrate reads it (the head, then the gap to the next pass plus its layer-0 excess), and against the
profile's price."""

from __future__ import annotations

import math

from types import SimpleNamespace

from dataclasses import replace

from cmoe.analysis.boundary import boundaries, boundary_price, boundary_rows, host_state, log_boundary_rows
from cmoe.calibrate.wake import boundary_pairs, pass_start_samples
from cmoe.core.hw import H200


def _pass(p: int, t: float, att0: float, wait: float, head: float, loads: int) -> list[tuple]:
    """Layer 0's host_attention att0 us from t, layer 1's 20 us at t + 300, the read-back wait at
    t + 400 (a shorter one earlier), the head after it."""
    spans = [("gpu", p, 0, "host", "host_attention", -1, t, t + att0),
             ("gpu", p, 1, "host", "host_attention", -1, t + 300, t + 320),
             ("gpu", p, 0, "host", "host_sync", -1, t + 100, t + 105),
             ("gpu", p, 1, "host", "host_sync", -1, t + 400, t + 400 + wait),
             ("gpu", p, -1, "host", "host_head", -1, t + 500 + wait, t + 500 + wait + head)]
    return spans + [("gpu", p, 1, "copy0", "load", k, t + 10, t + 20, 1) for k in range(loads)]


def test_a_boundary_is_the_head_then_the_gap_and_the_next_passs_excess():
    spans = (_pass(0, 0, 900, 9, 9, 9) + _pass(1, 1e4, 80, 140.0, 30.0, 2) + _pass(2, 2e4, 60, 1500.0, 170.0, 0)
             + _pass(3, 3e4, 250, 2000.0, 160.0, 20))
    passes = [{"pass": p, "decode": p > 0, "us": 1e4} for p in range(4)]
    run = SimpleNamespace(spans=spans, passes=passes)
    # pass 1's head ends at 1e4 + 670: the gap to pass 2 is 2e4 - 10670 = 9330, plus 60 - 20 = 40 of excess;
    # pass 2's ends at 2e4 + 2170, to pass 3: 7830 + 230; the prefill (pass 0) is not paired
    assert boundaries(run) == [(140.0, 30.0, 9370.0, 2, 1e4), (1500.0, 170.0, 8060.0, 0, 1e4)]
    run.passes[3]["decode"] = False                      # a pass after a prefill is not a boundary either
    assert boundaries(run) == [(140.0, 30.0, 9370.0, 2, 1e4)]


def test_a_boundarys_host_speed_is_the_next_passs_median_layer_past_its_first():
    # boundary_rows: the boundaries and, per row, the next pass's host speed, from one reading of the pairs
    spans = (_pass(0, 0, 900, 9, 9, 9) + _pass(1, 1e4, 80, 140.0, 30.0, 2) + _pass(2, 2e4, 60, 1500.0, 170.0, 0)
             + _pass(3, 3e4, 250, 2000.0, 160.0, 20))
    spans.append(("gpu", 2, 2, "host", "host_attention", -1, 2e4 + 350, 2e4 + 390))   # pass 2: layers 60, 20, 40 us
    run = SimpleNamespace(spans=spans, passes=[{"pass": p, "decode": p > 0, "us": 1e4} for p in range(4)])
    # one speed per boundary, in its order: pass 2's median of 20 and 40, pass 3's one 20
    assert len(boundaries(run)) == 2 and boundary_rows(run)[1] == [30.0, 20.0]
    log = SimpleNamespace(spans=spans, pass_us=[(p, p > 0, 0, 1e4) for p in range(4)])     # an executor's log
    assert log_boundary_rows(log) == boundary_rows(run) and log_boundary_rows(log)[1] == [30.0, 20.0]
    assert len(pass_start_samples(log)) == 2 and pass_start_samples(log, boundary_pairs(log)) == pass_start_samples(log)
    # slow at 25 us a layer: pass 2 (30), not pass 3 (20); boundaries 30 + 9330 + (60 - 30) and 170 + 7830 + 230
    assert host_state(log, 25.0) == (0.5, (9390.0 + 8230.0) / 2)
    assert all(math.isnan(x) for x in host_state(SimpleNamespace(spans=[], pass_us=[]), 25.0))
    run.passes[3]["decode"] = False                      # after a prefill: no boundary, no speed
    assert len(boundaries(run)) == 1 and boundary_rows(run)[1] == [30.0]
    run.passes[3]["decode"] = True
    run.spans.remove(next(s for s in spans if s[1] == 2 and s[4] == "host_head"))   # pass 2 lost its head
    assert len(boundaries(run)) == 1 and boundary_rows(run)[1] == [30.0]
    run.spans.remove(next(s for s in spans if s[1] == 2 and s[2] == 1 and s[4] == "host_attention"))
    assert len(boundaries(run)) == 1 and boundary_rows(run)[1] == [40.0]                  # pass 2: layers 60, 40
    run.spans.remove(next(s for s in spans if s[1] == 2 and s[2] == 2 and s[4] == "host_attention"))
    assert boundaries(run) == [] and boundary_rows(run)[1] == []                            # pass 2: one layer


def test_the_price_is_what_the_simulator_charges_for_the_same_passes():
    spans = (_pass(0, 0, 900, 9, 9, 9) + _pass(1, 1e4, 80, 140.0, 30.0, 2) + _pass(2, 2e4, 60, 1500.0, 170.0, 0)
             + _pass(3, 3e4, 250, 2000.0, 160.0, 20) + _pass(4, 4e4, 250, 100.0, 100.0, 20))
    run = SimpleNamespace(spans=spans, passes=[{"pass": p, "decode": p > 0, "us": 1e4} for p in range(5)])
    # boundaries: 30 + 9370, 170 + 8060, 160 + 7570 (pass 3's head ends at 3e4 + 2660, pass 4 enters at 4e4,
    # its layer-0 excess 230): the median 8230
    prof = replace(H200, host_head_us=50.0, host_pass_start_us=222.0, host_pass_start_points=((5e3, 0.0), (2e4, 128.0)))
    took, price = boundary_price(boundaries(run), prof)
    assert took == 8230.0 and price == 50.0 + 222.0 + prof.pass_start_extra_us(1e4)
    # a CPU-expert policy's own pass start, where calibrated, and no extra after a long pass
    cpu = replace(prof, cpu_pass_start_us=300.0)
    assert boundary_price(boundaries(run), cpu, cpu_experts=True) == (8230.0, 50.0 + 300.0)
    assert boundary_price(boundaries(run), cpu) == (took, price)
    free = replace(prof, host_head_us=0.0, host_pass_start_us=0.0, host_pass_start_points=())
    assert boundary_price(boundaries(run), free) is None
    for s in [s for s in run.spans if s[4] == "host_sync"]:            # no read-back: its host runs ahead
        run.spans.remove(s)
    assert boundary_price(boundaries(run), prof) is None
