"""What the lean executor's timeline shows that the simulator had to learn (issue 15): where a
pass's first mark lands, and commit's step between its attention and its launch. Each on a
hand-computed case, SimPy and the compiled replay alike (to the bit), and the calibrate side."""

from dataclasses import replace

import pytest

from cmoe.calibrate.profile_fit import _pass_gap_us
from tests.test_replay import FLAT, both, same_run, tiny_costs
from tests.test_sim import tiny_trace


def _attention_and_passes(prof):
    t = tiny_trace([0], [[0], [1], [0]], [[0], [1], [0]])
    a, b, _, _ = both(t, "upper", prof, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    return [(s[6], s[7]) for s in a.spans if s[4] == "attention"], [p[3] for p in a.pass_us]


def test_the_pass_gap_moves_layer_0s_span_start_not_the_pass():
    """`pass_gap_us`: of the host's 10 us pass start, the first 6 come before the executor's first
    mark (the GPU idles between passes), so layer 0's attention span starts 6 us into the pass
    and runs to the host's 10 plus its own 10; pass times do not move; a gap longer than the pass
    start is held to it."""
    base = replace(FLAT, host_pass_start_us=10.0, pass_start_us=4.0)
    spans, passes = _attention_and_passes(replace(base, pass_gap_us=6.0))
    assert spans == [(6.0, 20.0), (28.0, 42.0), (50.0, 64.0)]
    assert passes == [22.0, 22.0, 22.0]
    spans0, passes0 = _attention_and_passes(base)
    assert spans0 == [(0.0, 20.0), (22.0, 42.0), (44.0, 64.0)] and passes0 == passes
    spans_long, _ = _attention_and_passes(replace(base, pass_gap_us=50.0))
    assert spans_long == [(10.0, 20.0), (32.0, 42.0), (54.0, 64.0)]


def test_calibrate_takes_the_pass_gap_from_upper_s_own_run():
    """The lean engine's pass start comes from upper's own run: the host's side is the GPU's idle
    gap between passes plus layer 0's excess, the GPU's the excess alone; the gap is kept as
    `pass_gap_s`, or (measurements from before) taken as the difference; without the fused
    launches (the eager runs' host start-up is layer 0's own) it is 0."""
    m = {"layer": {"pass_start_s": 146e-6, "host": {"pass_start_s": 259e-6}}, "waves": [[2, 2, 8e-5, 1e8]]}
    assert _pass_gap_us(m) == pytest.approx(113.0)
    m["layer"]["host"]["pass_gap_s"] = 120e-6
    assert _pass_gap_us(m) == pytest.approx(120.0)
    assert _pass_gap_us({"layer": {"pass_start_s": 146e-6, "host": {"pass_start_s": 259e-6}}, "waves": []}) == 0.0
