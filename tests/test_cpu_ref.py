"""The host CPU's plain loop (`cmoe.core.cpu_ref`): timed at calibration and around each run, held
to each other by validate, said by `cmoe run`."""

from __future__ import annotations

import json

import pytest

from cmoe.core.cpu_ref import cpu_ref_line, cpu_ref_note, cpu_ref_ratio, cpu_ref_us, validation_ratio


def test_the_loop_time_grows_with_the_loop():
    short, long = cpu_ref_us(n=2000, reps=3), cpu_ref_us(n=200_000, reps=3)
    assert 0 < short < 1e6 and long > 10 * short


def test_the_ratio_is_the_runs_mean_over_the_calibrations():
    assert cpu_ref_ratio([1200.0, 1800.0], 1000.0) == pytest.approx(1.5)
    assert cpu_ref_ratio([900.0], 1200.0) == pytest.approx(0.75)
    assert cpu_ref_ratio([0.0, 1100.0], 1000.0) == pytest.approx(1.1)          # a reading of 0 is none
    for runs, prof in (([1200.0, 1800.0], None), ([1200.0, 1800.0], 0.0), (None, 1000.0), ([], 1000.0),
                       ([0.0], 1000.0)):
        assert cpu_ref_ratio(runs, prof) is None


def test_validate_says_the_loop_where_both_sides_recorded_it():
    v = {"cpu_ref_us": {"profile": 1000.0, "runs": [1200.0, 1800.0]}}
    assert validation_ratio(v) == pytest.approx(1.5)
    assert cpu_ref_line(v) == ("  the host CPU's plain loop took 1200 and 1800 us before and after the run, "
                               "1.50x its 1000 us at calibration (cmoe.core.cpu_ref)")
    for v in ({}, {"cpu_ref_us": {"profile": None, "runs": [1200.0, 1800.0]}},
              {"cpu_ref_us": {"profile": 1000.0, "runs": None}}):
        assert validation_ratio(v) is None and cpu_ref_line(v) is None


def test_cmoe_runs_note_gives_the_runs_range():
    assert cpu_ref_note([None, 1.5, 0.9]) == ("the host CPU's plain loop (`cmoe.core.cpu_ref`) took 0.90-1.50x "
                                              "its calibrated time around the runs")
    assert cpu_ref_note([1.501, 1.499]) == ("the host CPU's plain loop (`cmoe.core.cpu_ref`) took 1.50x its "
                                            "calibrated time around the runs")
    assert cpu_ref_note([None, None]) is None and cpu_ref_note([]) is None


def test_a_calibrations_readings_become_the_profiles_and_reach_the_simulators_metrics():
    """`device.cpu_ref_us` (calibrate's two readings) is fitted to their mean, with its source; a
    profile without it reads 0 and the simulator's metrics None; a negative one is refused."""
    from dataclasses import replace
    from cmoe.core.errors import CmoeError
    from cmoe.core.hw import H200, HardwareProfile
    from cmoe.calibrate.profile_fit import fit_profile
    from cmoe.sim.run import SimConfig, simulate
    from cmoe.core.spec import preset
    from cmoe.core.quant import recipe
    from cmoe.trace.synthetic import SyntheticParams, generate
    from tests.test_calibrate import _synthetic
    m = _synthetic(H200)
    bare = fit_profile("fit", m, H200.gpu_mem_bytes, "test", "2026-12-08")
    assert bare.cpu_ref_us == 0.0 and "cpu_ref_us" not in bare.sources
    m["device"] = {"cpu_ref_us": [1000.0, 1400.0]}
    got = fit_profile("fit", m, H200.gpu_mem_bytes, "test", "2026-12-08")
    assert got.cpu_ref_us == pytest.approx(1200.0)
    assert got.sources["cpu_ref_us"].endswith("(a fixed pure-Python loop before and after the measurements, "
                                              "cmoe.core.cpu_ref)")
    assert HardwareProfile.from_dict(json.loads(json.dumps(got.to_dict()))).cpu_ref_us == pytest.approx(1200.0)
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=4))
    for prof, want in ((H200, None), (replace(H200, cpu_ref_us=1234.5), 1234.5)):
        assert simulate(t, prof, SimConfig(policy="ondemand", pool_gb=20, batch=1)).metrics["cpu_ref_us"] == want
    with pytest.raises(CmoeError, match=r"^hardware profile 'h200': cpu_ref_us is -1"):
        HardwareProfile.from_dict(json.loads(json.dumps(H200.to_dict())) | {"cpu_ref_us": -1.0})
