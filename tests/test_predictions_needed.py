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
