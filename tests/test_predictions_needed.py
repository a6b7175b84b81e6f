"""A trace without next-layer predictions (an imported routing log) cannot drive a policy that
reads them: such a run is refused in one line, not reported (commit used to show 1.52x upper)."""

from dataclasses import replace

import numpy as np
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.trace import bundle
from cmoe.trace.load import load_trace
from cmoe.trace.passes import has_predictions


def _without_predictions(tmp_path):
    t = load_trace("embedded")
    bare = replace(t, pred_experts=np.full_like(t.pred_experts, -1), pred_ahead=None)   # as an imported log
    return t, bare, bundle.write(bare, tmp_path / "bare")


def test_a_trace_without_predictions_is_refused_by_policies_that_need_them(tmp_path):
    t, bare, path = _without_predictions(tmp_path)
    assert has_predictions(t) and not has_predictions(bare)
    runner = CliRunner()
    for policy in ("commit", "lru-prefetch", "adaptive-ahead", "commit-ahead"):
        r = runner.invoke(app, ["simulate", "--trace", str(path), "--policy", policy, "--pool-gb", "1"])
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: policy {policy} needs next-layer predictions")
        assert "Traceback" not in r.output
    r = runner.invoke(app, ["simulate", "--trace", str(path), "--policy", "ondemand,upper", "--pool-gb", "1"])
    assert r.exit_code == 0, r.output


def test_a_trace_one_layer_deep_is_refused_by_the_look_ahead_policies(tmp_path):
    """With distance 1 only, adaptive-ahead would never prefetch (no two predictions to agree) and
    commit-ahead neither, yet report under their names: refused, while commit and adaptive run."""
    t = load_trace("embedded")
    shallow = bundle.write(replace(t, pred_ahead=None), tmp_path / "shallow")
    assert t.depth == 4 and bundle.read(shallow).depth == 1
    runner = CliRunner()
    for policy in ("adaptive-ahead", "commit-ahead"):
        r = runner.invoke(app, ["simulate", "--trace", str(shallow), "--policy", policy, "--pool-gb", "1"])
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert lines == [f"error: policy {policy} looks 4 layers ahead but this trace's predictions reach 1: "
                         f"record one with cmoe trace --depth 4, or choose adaptive or commit"]
    r = runner.invoke(app, ["simulate", "--trace", str(shallow), "--policy", "commit,adaptive", "--pool-gb", "1"])
    assert r.exit_code == 0, r.output
