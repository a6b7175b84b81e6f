"""A calibration without the host's measured time around a CPU layer's experts cannot price a
CPU-expert policy (those costs read 0): simulate, sweep, `cmoe run --profile` and the API refuse a
policy named in one line, before any long work; asked for every policy, simulate, sweep and the API
leave those out and say so; GPU-only policies and the built-in estimates go through."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, HardwareProfile
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.sim.priced import priceable
from cmoe.sim.run import SimConfig, simulate
from cmoe.trace.synthetic import SyntheticParams, generate

SRC = "measured by cmoe calibrate on NVIDIA H100 80GB HBM3, 2026-12-06"
REFUSED = ("profile cal-test has no measured host time around a CPU layer's experts (cpu_lead_us and the rest: "
           "calibrated before cmoe fitted them, or with no CPU expert run inside the model), so it cannot "
           "price {p}: calibrate again (`cmoe calibrate`, its --policy naming them or all) or leave {p} out")
NOTE = ("left out lfu-fallback, static: profile cal-test has no measured host time around a CPU layer's experts "
        "(calibrate again with `cmoe calibrate`, its --policy naming them or all, to price them)")


def _calibrated(*measured: str) -> HardwareProfile:
    sources = {"cpu_expert_gbps": SRC, "roundtrip_us": SRC} | {f: SRC + " (around each CPU layer)" for f in measured}
    return HardwareProfile.from_dict({**H200.to_dict(), "name": "cal-test", "sources": sources})


def _file(tmp_path, prof: HardwareProfile):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(prof.to_dict()))
    return path


def test_the_profile_says_whether_its_calibration_measured_the_cpu_layer():
    assert _calibrated().cpu_layer_unmeasured()
    for f in ("cpu_lead_us", "cpu_gap_us", "cpu_tail_us"):     # any of the three: a top-1 model may lack the lead
        assert not _calibrated(f).cpu_layer_unmeasured()
    assert not H200.cpu_layer_unmeasured()          # the built-in estimates say so in their sources


def test_priceable_refuses_a_named_policy_and_leaves_out_of_every_one():
    names = ["upper", "lfu-fallback", "static", "commit"]
    with pytest.raises(CmoeError) as e:
        priceable(_calibrated(), names, every=False)
    assert str(e.value) == REFUSED.format(p="lfu-fallback, static")      # every one it cannot price, named once
    assert priceable(_calibrated(), names, every=True) == (["upper", "commit"], NOTE)
    with pytest.raises(CmoeError) as e:                                  # nothing left to price
        priceable(_calibrated(), ["static"], every=True)
    assert str(e.value) == REFUSED.format(p="static")
    assert priceable(_calibrated("cpu_lead_us"), names, every=False) == (names, None)
    assert priceable(H200, names, every=False) == (names, None)


def test_simulate_refuses_cpu_expert_policies_only():
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, decode_len=2))
    for pol in ("lfu-fallback", "static"):
        with pytest.raises(CmoeError) as e:
            simulate(t, _calibrated(), SimConfig(policy=pol, pool_gb=20))
        assert str(e.value) == REFUSED.format(p=pol)
        assert simulate(t, _calibrated("cpu_gap_us"), SimConfig(policy=pol, pool_gb=20)).metrics["policy"] == pol
    assert simulate(t, _calibrated(), SimConfig(policy="ondemand", pool_gb=20)).metrics["policy"] == "ondemand"


def test_the_cli_leaves_out_of_all_and_refuses_a_named_one_in_one_line(tmp_path):
    from cmoe.cli.app import app
    prof = _file(tmp_path, _calibrated())
    base = ["simulate", "--trace", "synthetic:mixtral-8x7b", "--profile", str(prof), "--pool-gb", "20"]
    r = CliRunner().invoke(app, base + ["--policy", "upper,static"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == ["error: " + REFUSED.format(p="static")]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0 and NOTE in r.output
    rows = [ln.split()[0] for ln in r.output.splitlines() if ln.startswith(("upper", "lfu-fallback", "static "))]
    assert rows == ["upper"]


def test_the_api_warns_for_all_and_refuses_a_named_one(tmp_path):
    import cmoe
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, decode_len=2))
    with pytest.warns(UserWarning, match="cmoe.simulate: left out lfu-fallback, static"):
        got = cmoe.simulate(t, profile=_calibrated(), policies="all")
    assert "static" not in [r.metrics["policy"] for r in got] and "upper" in [r.metrics["policy"] for r in got]
    with pytest.raises(CmoeError, match="so it cannot price static"):
        cmoe.simulate("no-such-trace-is-read", profile=_calibrated(), policies=["static"])


def test_sweep_refuses_a_named_policy_before_any_point_runs(tmp_path):
    from cmoe.sweep import grid, sweep
    pts = grid(traces=["synthetic:mixtral-8x7b"], profiles=[str(_file(tmp_path, _calibrated()))], pools=[20.0],
               policies=["upper", "static"], batches=[1])
    with pytest.raises(CmoeError, match="so it cannot price static"):
        sweep(pts, tmp_path / "s.parquet", jobs=1, progress=False)
    assert not (tmp_path / "s.parquet").exists()


def test_run_refuses_before_building(tmp_path, monkeypatch):
    import cmoe.executor.run as ex
    from cmoe.pipeline import run_all
    monkeypatch.setattr(ex, "build", lambda *a, **k: pytest.fail("built before refusing"))
    monkeypatch.setattr(ex, "prepare", lambda *a, **k: pytest.fail("prepared before refusing"))
    with pytest.raises(CmoeError, match="so it cannot price static"):
        run_all(tmp_path / "run", spec_name=None, model_dir=None, trace_src=None, policies=("upper", "static"),
                pool_gb=20.0, batch=1, tokens=4, quant=None, device="cpu", profile=str(_file(tmp_path, _calibrated())),
                echo=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_a_sweep_of_every_policy_drops_only_the_points_a_profile_cannot_price(tmp_path, capsys):
    from cmoe.cli.sim_cmds import _priceable_points
    from cmoe.sweep import grid
    cal = str(_file(tmp_path, _calibrated()))
    pts = grid(traces=["synthetic:mixtral-8x7b"], profiles=[cal, "h200"], pools=[20.0],
               policies=["upper", "lfu-fallback", "static"], batches=[1])
    kept = _priceable_points(pts)
    assert [(p["profile"], p["policy"]) for p in kept] == [(cal, "upper"), ("h200", "upper"), ("h200", "lfu-fallback"),
                                                           ("h200", "static")]
    assert capsys.readouterr().err.strip() == NOTE
