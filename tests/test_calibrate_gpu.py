"""`cmoe calibrate`'s model runs on CUDA (marked `gpu`, skipped without it): the store is built for
the policies the profile will serve. Named GPU-only policies alone, it holds no CPU copies of the
experts and no `static` run measures CPU experts inside the model; otherwise both happen. On a CPU
a store holds no CPU copies either way, so only the build's policies show there
(`test_calibrate.py::test_a_calibration_for_gpu_only_policies_prices_no_cpu_layer`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cpu_experts", [False, True])
def test_the_calibrations_store_holds_cpu_copies_only_for_cpu_expert_policies(fused_checkpoints, monkeypatch,
                                                                               cpu_experts):
    import cmoe.executor.run as run
    from cmoe.calibrate import measure_model as mm
    from cmoe.core.checkpoint import check_checkpoint
    built, stores, ran = [], [], []
    build, run_policy = run.build, run.run_policy

    def watched_build(w, cfg, *a, **k):
        built.append(cfg.policies)
        out = build(w, cfg, *a, **k)
        stores.append(w.store)
        return out

    def watched_run(w, cfg, name, *a, **k):
        ran.append(name)
        return run_policy(w, cfg, name, *a, **k)
    monkeypatch.setattr(run, "build", watched_build)
    monkeypatch.setattr(run, "run_policy", watched_run)
    d = fused_checkpoints["mixtral"]
    out = mm.layers(torch.device("cuda"), check_checkpoint(d), "w4g32", 2, d, tokens=4, cpu_experts=cpu_experts)
    assert built == ([("upper", "static")] if cpu_experts else [("upper",)])     # built once
    assert (stores[0].cpu_twins is not None) is cpu_experts
    assert ("static" in ran) is cpu_experts
    assert ("cpu_expert_in_model" in out) is cpu_experts
    rows = out["layer"]["host"].get("loading_pass_start_samples") or []    # the loading ondemand run's boundaries,
    assert rows and all(len(x) == 8 and x[7] > 0 for x in rows)          # each with the next pass's host speed
    if cpu_experts:                           # batches 1 and 8 measured their CPU experts inside the model
        assert sum(n for _, n in out["cpu_expert_in_model"]["count"]) > 0
