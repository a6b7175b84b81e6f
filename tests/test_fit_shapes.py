"""Calibration fits the shape its points show (issue 15): an expert's time that is flat from one
row to two and then rises (a hinge), and a host cost that falls with batch, come back from
synthetic measurements made with known values, where a line through them would not: the old fit
clamped the falling host cost's slope to 0, so every batch paid the one-token cost. The simulator
reads the tables the same way in both of its engines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cmoe.core.hw import H200, HardwareProfile, table_us
from cmoe.calibrate.profile_fit import fit_line, fit_profile
from tests.test_calibrate import _synthetic

# the H200 probe of issue 15: in-model expert time (us) at 1, 2, 4, 8, 16 rows; host cost per expert
HINGE = {1: 69.0, 2: 69.0, 4: 93.0, 8: 141.0, 16: 224.0}
FALLING = {1: 177.0, 4: 120.0, 8: 105.0}
BYTES, PARAMS = 93_585_408, 3 * 4096 * 14336


def _measured() -> dict:
    m = _synthetic(H200)
    m["expert"]["points"] = [(t, us / 1e6) for t, us in HINGE.items()] + [(4, 2 * HINGE[4] / 1e6)]  # a slow repeat
    m["layer"]["expert_in_model_s"] = HINGE[1] / 1e6
    m["layer"]["host"]["expert_points"] = [(t, us / 1e6) for t, us in FALLING.items()]
    return m


def test_the_fit_recovers_a_hinge_and_a_falling_host_cost():
    p = fit_profile("shapes", _measured(), H200.gpu_mem_bytes, "test", "2026-12-01")
    for t, us in HINGE.items():
        assert p.expert_us(BYTES, 4, t, PARAMS) == pytest.approx(us)
    assert p.expert_us(BYTES, 4, 3, PARAMS) == pytest.approx((69.0 + 93.0) / 2)      # between points: linear
    assert p.expert_us(BYTES, 4, 32, PARAMS) == pytest.approx(224.0 + (224.0 - 141.0) * 2)   # rising: extended
    assert p.expert_us(BYTES // 2, 4, 2, PARAMS) == pytest.approx(69.0 / 2)           # scaled by bytes
    for t, us in FALLING.items():
        assert p.host_expert(t) == pytest.approx(us)
    assert p.host_expert(6) == pytest.approx(112.5)
    assert p.host_expert(64) == pytest.approx(105.0)                 # a falling cost flattens, never below
    # what the line did with the same points: the host's slope clamped to 0, every batch at ~one token
    a, b = fit_line([(t - 1, us) for t, us in FALLING.items()])
    assert b < 0 and p.host_expert_us_per_token == 0.0
    # the profile round-trips through JSON with its tables
    assert HardwareProfile.from_dict(p.to_dict()) == p


def test_running_in_the_model_adds_an_excess_not_a_factor():
    """The per-expert loop's experts: the isolated curve plus the in-model excess measured at each
    batch (rows on the dense path), read between them by rows and held past the last. Before, one
    factor from one row scaled every row (here 1.4x: 8 rows at 980 us where the model took 760)."""
    m = _synthetic(H200)
    iso = {1: 100.0, 2: 190.0, 4: 360.0, 8: 700.0, 16: 1380.0}
    m["expert"]["points"] = [(t, us / 1e6) for t, us in iso.items()]
    m["layer"]["expert_in_model_s"] = 140e-6
    m["layer"]["expert_points"] = [(1, 140e-6), (8, 760e-6)]             # +40 us at one row, +60 at 8
    m["dense_rows"], m["silent_upper"] = 16, False
    p = fit_profile("excess", m, H200.gpu_mem_bytes, "test", "2026-12-07")
    got = dict(p.expert_rows_us)
    assert got == pytest.approx({1: 140.0, 2: 190.0 + 40 + 20 / 7, 4: 360.0 + 40 + 60 / 7, 8: 760.0, 16: 1440.0})
    # batches past the dense path do not say what an expert of that many rows took: one row's alone
    m["dense_rows"] = 0
    got = dict(fit_profile("excess", m, H200.gpu_mem_bytes, "test", "2026-12-07").expert_rows_us)
    assert got == pytest.approx({t: us + 40.0 for t, us in iso.items()})
    # an excess below zero (the model's run faster than the isolated loop's) is kept, never below half
    m["dense_rows"], m["expert"]["points"] = 16, [(1, 100e-6), (2, 110e-6), (4, 120e-6), (8, 700e-6)]
    m["layer"]["expert_points"] = [(1, 90e-6), (8, 300e-6), (4, 0.0)]         # a zero is no measurement
    got = dict(fit_profile("excess", m, H200.gpu_mem_bytes, "test", "2026-12-07").expert_rows_us)
    assert got == pytest.approx({1: 90.0, 2: 55.0, 4: 60.0, 8: 350.0})    # 2 rows: 110 - 10 - 390 / 7 < 55
    # the lean engine's fused launch has no per-expert table at all
    m["silent_upper"] = True
    assert fit_profile("excess", m, H200.gpu_mem_bytes, "test", "2026-12-07").expert_rows_us == ()


def test_tables_are_validated_where_a_profile_is_made():
    with pytest.raises(Exception, match="host_expert_points"):
        replace(H200, host_expert_points=((4, 1.0), (1, 2.0)))          # rows not ascending
    with pytest.raises(Exception, match="expert_rows_bytes"):
        replace(H200, expert_rows_us=((1, 50.0),))                      # a table with no size


def test_table_reading():
    pts = ((1, 10.0), (3, 30.0), (5, 20.0))
    assert [table_us(pts, x) for x in (0, 1, 2, 3, 4, 5, 9)] == [10.0, 10.0, 20.0, 30.0, 25.0, 20.0, 20.0]
    assert table_us(((2, 7.0),), 100) == 7.0


def test_both_simulator_engines_read_the_tables_alike():
    from cmoe.core.quant import recipe
    from cmoe.core.spec import preset
    from cmoe.trace.synthetic import SyntheticParams, generate
    from tests.test_replay import EAGER, both, same_run
    p = fit_profile("shapes", _measured(), H200.gpu_mem_bytes, "test", "2026-12-01")
    prof = replace(EAGER, expert_rows_us=p.expert_rows_us, expert_rows_bytes=p.expert_rows_bytes,
                   expert_rows_class=p.expert_rows_class, host_expert_points=p.host_expert_points,
                   host_layer_points=((1, 900.0), (4, 700.0)), host_route_points=((1, 100.0), (4, 60.0)))
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=4, prompt_len=6, decode_len=10))
    runs = {}
    for policy in ("upper", "ondemand", "commit"):
        a, b, _, _ = both(t, policy, prof, 4)
        same_run(a, b)
        runs[policy] = a
    # and the tables change the answer: the line profile's host costs do not fall with batch
    line, _, _, _ = both(t, "ondemand", EAGER, 4)
    assert sum(us for *_, us in runs["ondemand"].pass_us) < sum(us for *_, us in line.pass_us)
