"""The host thread pinned around a run's passes (`cmoe.executor.affinity`, `CMOE_PIN_HOST`): which
core each setting names, the one-line refusals, the mask restored, torch's team started first, and
which runs read the variable (a CUDA run of a GPU-only policy; on the CPU none, over a tiny
checkpoint)."""

from __future__ import annotations

import os

import pytest

from cmoe.core.errors import CmoeError
from cmoe.executor import run as run_mod
from cmoe.executor.affinity import ENV, check_pin, pin_core, pinned_host, run_setting
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
    from cmoe.executor import affinity
    before = os.sched_getaffinity(0)
    want = sorted(before)[min(1, len(before) - 1)]
    team = []
    start = affinity._start_team
    monkeypatch.setattr(affinity, "_start_team", lambda: (team.append(os.sched_getaffinity(0)), start()))
    with pinned_host("auto") as core:
        assert core == want and os.sched_getaffinity(0) == {want}
    assert team == [before]                                 # torch's team started before the pin, on every core
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


def test_only_a_cuda_run_of_a_gpu_only_policy_reads_the_variable():
    assert run_setting(cuda=True, cpu_experts=False) is None
    assert run_setting(cuda=True, cpu_experts=True) == "off"
    assert run_setting(cuda=False, cpu_experts=False) == "off"


def test_without_sched_setaffinity_a_setting_is_refused(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setenv(ENV, "auto")
    with pytest.raises(CmoeError, match=r"^CMOE_PIN_HOST=auto needs Linux's sched_setaffinity, which this OS lacks: unset it$"):
        check_pin()
    monkeypatch.setenv(ENV, "off")
    check_pin()


@linux
def test_a_cpu_run_is_never_pinned(checkpoints, tiny_trace, monkeypatch):
    """On the CPU the model runs on torch's team, so even with the variable set nothing is pinned;
    a bad setting is refused before any work."""
    before = os.sched_getaffinity(0)
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
    assert got == {"ondemand": None, "lfu-fallback": None}
    assert seen == [before, before] and os.sched_getaffinity(0) == before
    monkeypatch.setenv(ENV, "core:99999")
    with pytest.raises(CmoeError, match="core 99999 is not one this process may use"):
        prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
