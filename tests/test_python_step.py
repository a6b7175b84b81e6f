"""The executor's Python step: with the compiled host program off (`CMOE_HOST_PROGRAM=0`) every
policy that plans runs it, whose host costs calibrate measures apart (`HardwareProfile.python_host`)
and the simulator charges to the runs that took it (`SimConfig.python_step`)."""

import json
from dataclasses import replace

import pytest

from cmoe.calibrate.host_fit import host_fields, python_host
from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, HardwareProfile
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.policy.policies import POLICIES, python_step
from cmoe.sim.run import SimConfig, simulate
from cmoe.trace.synthetic import SyntheticParams, generate
from tests.test_replay import LEAN

PY = {"host_route_us": 300.0, "host_sync_us": 200.0, "host_expert_us": 90.0,      # above LEAN's 100, 80 and 40
      "host_route_points": ((1, 300.0), (8, 230.0)), "host_pass_start_us": 400.0}


def test_the_python_step_plans_where_the_program_is_off():
    """The program plans every built-in policy (the CPU-expert ones too, since it calls back for
    their CPU work); off, all but `upper`, which plans nothing, take the Python step."""
    assert [p for p in POLICIES if python_step(p)] == []
    assert [p for p in POLICIES if python_step(p, program=False)] == [p for p in POLICIES if p != "upper"]
    assert not python_step("no-such-policy", program=False)


def test_the_python_step_replaces_the_host_fields_it_holds_and_survives_json():
    p = replace(H200, host_route_us=1.0, host_layer_us=2.0, python_host=PY)
    q = p.python_step()
    assert (q.host_route_us, q.host_sync_us, q.host_expert_us, q.host_pass_start_us) == (300.0, 200.0, 90.0, 400.0)
    assert q.host_layer_us == 2.0 and q.python_host == {} and q.host_route(4) == pytest.approx(300.0 - 70.0 * 3 / 7)
    assert H200.python_step() is H200                      # none measured: the program's costs stand
    back = HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.python_step() == q
    assert p.host_scaled(2.0).python_step().host_route_points == ((1, 600.0), (8, 460.0))
    with pytest.raises(CmoeError, match="python_host"):
        replace(H200, python_host={"hbm_gbps": 1.0})     # a GPU field is not the host's
    with pytest.raises(CmoeError, match="host_sync_us"):
        replace(H200, python_host={"host_sync_us": -1.0})


@pytest.mark.parametrize("engine", ["replay", "simpy"])
def test_the_simulator_charges_the_python_step_to_the_runs_that_take_it(engine):
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=2, prompt_len=6, decode_len=10))
    prof = replace(LEAN, python_host=PY)
    for policy in ("static", "lfu-fallback", "ondemand", "commit"):
        cfg = SimConfig(policy=policy, pool_gb=12, batch=2, engine=engine)
        got = simulate(t, prof, cfg).metrics
        assert got == simulate(t, LEAN, cfg).metrics            # the program's host: python_host unread
        stepped = simulate(t, prof, replace(cfg, python_step=True)).metrics
        assert stepped == simulate(t, replace(LEAN, **{k: v for k, v in PY.items()}), cfg).metrics, policy
        assert stepped["tokens_per_s"] < got["tokens_per_s"], policy


def test_the_python_steps_fields_come_from_its_own_runs_over_the_programs():
    """Calibrate's `host_python` (the runs with the program off) over its `host` (the program's):
    the table points, read-back, pass start and head are the step's own; what it did not measure
    (a load's issue, the wake) stays the program's; GPU fields never enter."""
    host = {"layer_points": [(1, 2e-6), (8, 3e-6)], "route_points": [(1, 1e-6), (8, 2e-6)],
            "expert_points": [(1, 5e-6), (8, 6e-6)], "expert_tail_s": 1e-6, "load_s": 4e-6, "sync_s": 12e-6,
            "pass_start_s": 110e-6, "head_s": 25e-6, "wake_points": [(1e-4, 1.0), (1e-3, 1.5)]}
    py = {"layer_points": [(1, 10e-6), (8, 12e-6)], "route_points": [(1, 13e-6), (8, 20e-6)],
          "expert_points": [(1, 30e-6), (8, 40e-6)], "expert_tail_s": 2e-6, "sync_s": 15e-6,
          "pass_start_s": None, "head_s": 60e-6}
    got = python_host({"host": host, "host_python": py})
    assert got["host_route_points"] == ((1, 13.0), (8, 20.0)) and got["host_expert_points"] == ((1, 30.0), (8, 40.0))
    assert got["host_route_us"] == pytest.approx(13.0) and got["host_route_us_per_token"] == pytest.approx(1.0)
    assert (got["host_sync_us"], got["host_head_us"], got["host_expert_tail_us"]) == pytest.approx((15.0, 60.0, 2.0))
    assert got["host_pass_start_us"] == pytest.approx(110.0)    # none of its own (passes not queued): the program's
    assert got["host_load_us"] == pytest.approx(4.0) and "host_wake_points" not in got
    assert set(got) <= set(host_fields(host))
    assert python_host({"host": host}) == {} and python_host({"host_python": py}) == {}
    replace(H200, python_host=got).python_step()           # a profile takes what the fit gives


def test_calibrate_fits_the_python_step_and_shows_it_beside_its_runs():
    """Measurements with the Python step's runs fit into `python_host` (its sources say where it comes
    from) and `beside` puts each of its route and launch points next to the step's fitted cost;
    measurements without them (a CPU's, or an older calibration's refit) fit none."""
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import fit_profile
    from tests.test_calibrate import _synthetic
    m = _synthetic(H200)
    assert fit_profile("fit", m, H200.gpu_mem_bytes, "test", "2026-12-05").python_host == {}
    m["layer"]["host_python"] = {"layer_points": [(1, 10e-6), (8, 12e-6)], "route_points": [(1, 13e-6), (8, 20e-6)],
                                 "expert_points": [(1, 30e-6), (8, 40e-6)], "expert_tail_s": 2e-6, "sync_s": 15e-6,
                                 "pass_start_s": 300e-6, "head_s": 60e-6}
    got = fit_profile("fit", m, H200.gpu_mem_bytes, "test", "2026-12-05")
    step = got.python_step()
    assert step.host_route_points == ((1, pytest.approx(13.0)), (8, pytest.approx(20.0)))
    assert (step.host_pass_start_us, step.host_sync_us) == pytest.approx((300.0, 15.0))
    assert got.host_route_points != step.host_route_points and "host program off" in got.sources["python_host"]
    rows = {line[:28].strip(): line[28:].split() for line in beside(got, m).splitlines()}
    assert rows["Py step, route, 8 tokens"][:2] == ["20.0us", "20.0us"]
    assert rows["Py step, expert, 1 tokens"][:2] == ["30.0us", "30.0us"]


def test_a_bad_python_host_is_one_line_and_json_lists_compare_as_tuples(tmp_path):
    """Whatever the JSON holds there: one CmoeError line when the profile is read (never a
    traceback later, in `host_scaled` or the simulator), and a profile written with list tables
    equal to its own round trip."""
    from cmoe.core.hw import load_profile
    for bad in (None, [], 0, "", [1], {"host_route_points": [[1, -2.0]]}, {"host_sync_us": None},
                {"host_layer_points": ""}, {"host_route_points": {}}):
        f = tmp_path / "p.json"
        f.write_text(json.dumps(H200.to_dict() | {"python_host": bad}))
        with pytest.raises(CmoeError, match="python_host|host_route_points|host_sync_us|host_layer_points"):
            load_profile(str(f))
    for field, bad in (("host_layer_points", 0), ("host_wake_points", ""), ("expert_rows_us", {})):
        f.write_text(json.dumps(H200.to_dict() | {field: bad}))          # the profile's own tables alike
        with pytest.raises(CmoeError, match=field):
            load_profile(str(f))
    p = replace(H200, python_host={"host_route_points": [[1, 2.0], [8, 1.0]], "host_expert_points": None})
    assert p.python_host == {"host_route_points": ((1, 2.0), (8, 1.0)), "host_expert_points": ()}
    assert HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert p.host_scaled(2.0).python_step().host_route_points == ((1, 4.0), (8, 2.0))


def test_the_host_speed_of_a_python_step_run_is_read_against_the_steps_own_host():
    """`cmoe.pipeline.host_ratio`: the measured host time per layer of a run its program did not plan
    (`host_program` false) over the Python step's calibrated one, every other run's over the
    program's (one that does not say: the program's)."""
    from cmoe.pipeline import host_ratio
    p = replace(H200, host_layer_us=10.0, python_host={"host_layer_us": 40.0})
    for policy in ("static", "ondemand"):
        assert host_ratio({"policy": policy, "host_layer_us": 40.0, "host_program": False}, p, 1) == pytest.approx(1.0)
        assert host_ratio({"policy": policy, "host_layer_us": 40.0, "host_program": True}, p, 1) == pytest.approx(4.0)
        assert host_ratio({"policy": policy, "host_layer_us": 40.0}, p, 1) == pytest.approx(4.0)


def test_the_steps_switch_sets_one_variable_and_restores_it(monkeypatch):
    """`cmoe.core.util.env_var`, which calibrate turns the host program off with: the variable as it
    was after the block (set or unset), and what the block set besides left alone."""
    import os

    from cmoe.core.util import env_var
    monkeypatch.delenv("CMOE_HOST_PROGRAM", raising=False)
    monkeypatch.delenv("CMOE_TEST_INSIDE", raising=False)
    with env_var("CMOE_HOST_PROGRAM", "0"):
        assert os.environ["CMOE_HOST_PROGRAM"] == "0"
        os.environ["CMOE_TEST_INSIDE"] = "kept"
    assert "CMOE_HOST_PROGRAM" not in os.environ and os.environ.pop("CMOE_TEST_INSIDE") == "kept"
    monkeypatch.setenv("CMOE_HOST_PROGRAM", "1")
    with pytest.raises(RuntimeError), env_var("CMOE_HOST_PROGRAM", "0"):
        raise RuntimeError
    assert os.environ["CMOE_HOST_PROGRAM"] == "1"



def test_predict_charges_the_python_step_where_the_runs_take_it(monkeypatch):
    """`cmoe.pipeline.predict`: with the program on, no policy's simulation takes the Python step;
    with CMOE_HOST_PROGRAM=0, every planning policy's; a caller that knows how its runs went (the
    measured `host_program`, `benchmarks/validate_table.py`) names them."""
    from types import SimpleNamespace as NS

    import cmoe.sim.api
    import cmoe.sim.run
    from cmoe.pipeline import predict
    seen = []
    monkeypatch.setattr(cmoe.sim.run, "simulate", lambda t, prof, cfg: seen.append((cfg.policy, cfg.python_step)))
    monkeypatch.setattr(cmoe.sim.api, "write_outputs", lambda *a: None)
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=4, decode_len=4))
    w = NS(trace=t, spec=t.spec, fmt="w4g128")
    cfg = NS(policies=("upper", "static", "ondemand"), pool_gb=12, batch=1, slots=None, include_prefill=True, tokens=2)
    for flag, want in (("1", set()), ("0", {"static", "ondemand"})):
        monkeypatch.setenv("CMOE_HOST_PROGRAM", flag)
        seen.clear()
        predict(w, cfg, LEAN, None)
        assert {p for p, stepped in seen if stepped} == want and len(seen) == 3
    seen.clear()
    predict(w, NS(**vars(cfg), python_step={"upper"}), LEAN, None)
    assert seen == [("upper", True), ("static", False), ("ondemand", False)]
