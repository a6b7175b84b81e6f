"""A calibration that never ran CPU experts inside the model cannot price a CPU-expert policy's CPU
layers (the host's time around them reads 0): simulate, sweep and `cmoe run --profile` refuse it in
one line, before any long work; GPU-only policies and the built-in estimates go through."""

from __future__ import annotations

import json

import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, HardwareProfile
from cmoe.core.spec import preset
from cmoe.core.quant import recipe
from cmoe.sim.run import SimConfig, simulate
from cmoe.trace.synthetic import SyntheticParams, generate

SRC = "measured by cmoe calibrate on NVIDIA H100 80GB HBM3, 2026-12-06"


def _calibrated(cpu_layer: bool) -> HardwareProfile:
    sources = {"cpu_expert_gbps": SRC, "roundtrip_us": SRC} | ({"cpu_lead_us": SRC + " (around each CPU layer)"}
                                                              if cpu_layer else {})
    return HardwareProfile.from_dict({**H200.to_dict(), "name": "cal-test", "sources": sources})


def test_the_profile_says_whether_its_calibration_saw_the_cpu_layer():
    assert _calibrated(False).cpu_layer_unmeasured()
    assert not _calibrated(True).cpu_layer_unmeasured()
    assert not H200.cpu_layer_unmeasured()          # the built-in estimates say so in their sources


def test_simulate_refuses_cpu_expert_policies_only():
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, decode_len=2))
    for pol in ("lfu-fallback", "static"):
        with pytest.raises(CmoeError, match=f"cal-test was calibrated without CPU experts in the model, so it "
                                            f"cannot price {pol}'s CPU layers"):
            simulate(t, _calibrated(False), SimConfig(policy=pol, pool_gb=20))
        assert simulate(t, _calibrated(True), SimConfig(policy=pol, pool_gb=20)).metrics["policy"] == pol
    assert simulate(t, _calibrated(False), SimConfig(policy="ondemand", pool_gb=20)).metrics["policy"] == "ondemand"


def test_sweep_refuses_before_any_point_runs(tmp_path):
    from cmoe.sweep import grid, sweep
    prof = tmp_path / "cal.json"
    prof.write_text(json.dumps(_calibrated(False).to_dict()))
    pts = grid(traces=["synthetic:mixtral-8x7b"], profiles=[str(prof)], pools=[20.0], policies=["upper", "static"],
               batches=[1])
    with pytest.raises(CmoeError, match="cannot price static's CPU layers"):
        sweep(pts, tmp_path / "s.parquet", jobs=1, progress=False)
    assert not (tmp_path / "s.parquet").exists()


def test_run_refuses_before_building(tmp_path, monkeypatch):
    import cmoe.executor.run as ex
    from cmoe.pipeline import run_all
    prof = tmp_path / "cal.json"
    prof.write_text(json.dumps(_calibrated(False).to_dict()))
    monkeypatch.setattr(ex, "build", lambda *a, **k: pytest.fail("built before refusing"))
    with pytest.raises(CmoeError, match="cannot price static's CPU layers"):
        run_all(tmp_path / "run", spec_name=None, model_dir=None, trace_src=None, policies=("upper", "static"),
                pool_gb=20.0, batch=1, tokens=4, quant=None, device="cpu", profile=str(prof), echo=lambda *_: None)
    assert not (tmp_path / "run").exists()
