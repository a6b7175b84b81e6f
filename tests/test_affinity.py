"""The host thread pinned around a run's passes (`cmoe.executor.affinity`, `CMOE_PIN_HOST`): which
core each setting names, the one-line refusals, the mask restored, and the executor pinning a
GPU-only policy's passes but never a CPU-expert policy's (on the CPU, over a tiny checkpoint)."""

from __future__ import annotations

import os

import pytest

from cmoe.core.errors import CmoeError
from cmoe.executor import run as run_mod
from cmoe.executor.affinity import ENV, pin_core, pinned_host
from cmoe.executor.run import ExecConfig, execute, prepare

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")


def test_each_setting_names_its_core():
    assert pin_core("", {0, 1, 2}) is None and pin_core(" OFF ", {0, 1, 2}) is None
    assert pin_core("auto", {0, 1, 2}) == 1
    assert pin_core("auto", {5}) == 5                      # one core allowed: that one
    assert pin_core("auto", {3, 7, 9}) == 7
    assert pin_core("core:2", {0, 1, 2}) == 2
    with pytest.raises(CmoeError, match=r"CMOE_PIN_HOST=core:4: core 4 is not one this process may use \(cores 0-2\)"):
        pin_core("core:4", {0, 1, 2})
    with pytest.raises(CmoeError, match=r"\(cores \[0, 2\]\)"):
        pin_core("core:1", {0, 2})
    for bad in ("1", "on", "core:", "core:-1", "core:x"):
        with pytest.raises(CmoeError, match=r"is not a setting: use auto, core:N or off"):
            pin_core(bad, {0, 1})


@linux
def test_the_pin_holds_inside_and_the_mask_comes_back(monkeypatch):
    before = os.sched_getaffinity(0)
    want = sorted(before)[min(1, len(before) - 1)]
    with pinned_host("auto") as core:
        assert core == want and os.sched_getaffinity(0) == {want}
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError, match="inside"):
        with pinned_host("auto"):
            raise RuntimeError("inside")
    assert os.sched_getaffinity(0) == before                # restored after a raise too
    monkeypatch.delenv(ENV, raising=False)
    with pinned_host() as core:                             # unset: off
        assert core is None and os.sched_getaffinity(0) == before
    monkeypatch.setenv(ENV, f"core:{want}")
    with pinned_host() as core:
        assert core == want and os.sched_getaffinity(0) == {want}
    assert os.sched_getaffinity(0) == before


@linux
def test_the_executor_pins_gpu_only_passes_not_cpu_experts(checkpoints, tiny_trace, monkeypatch):
    before = os.sched_getaffinity(0)
    want = sorted(before)[min(1, len(before) - 1)]
    seen = []
    inner = run_mod._passes

    def spy(eng, w, cfg, cache, passes):
        seen.append(os.sched_getaffinity(0))
        return inner(eng, w, cfg, cache, passes)
    monkeypatch.setattr(run_mod, "_passes", spy)
    monkeypatch.setenv(ENV, "auto")
    cfg = ExecConfig(policies=("ondemand", "lfu-fallback"), slots=2, batch=1, tokens=2, device="cpu", quant="fp32")
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    got = {r.policy: r.metrics["host_core"] for r in execute(w, cfg)}
    assert got == {"ondemand": want, "lfu-fallback": None}
    assert seen == [{want}, before] and os.sched_getaffinity(0) == before
    monkeypatch.setenv(ENV, "core:99999")                  # refused before any work, in prepare
    with pytest.raises(CmoeError, match="core 99999 is not one this process may use"):
        prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
