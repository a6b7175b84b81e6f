"""`benchmarks/validate_table.py`'s table: the host column marks the policies whose host step
calibrate does not time (`cmoe.pipeline.host_timed`)."""

from __future__ import annotations

from benchmarks.validate_table import HOST_NOTE, table
from cmoe.pipeline import host_timed


def _row(policy: str, host: float | None) -> dict:
    return {"pool_gb": 20.0, "experts_fit": 176, "batch": 1, "policy": policy, "predicted_tok_s": 100.0,
            "measured_tok_s": [99.0], "error": 0.0101, "spread": 0.0, "predicted_tpot_ms": 10.0,
            "measured_tpot_ms": 10.1, "layer_mean_error_worst": [0.02], "layer_worst": [3],
            "layer_mape_mean": [0.01], "host_speed": [host], "link_speed": [], "slow_loads": []}


def test_the_host_column_stars_what_calibrate_does_not_time():
    assert [host_timed(p) for p in ("upper", "commit", "commit-ahead", "ondemand", "oracle", "static")] == [
        False, False, False, True, True, True]
    lines = table([_row("upper", 1.67), _row("ondemand", 1.13), _row("commit", None)]).splitlines()[2:]
    assert [ln.split(" | ")[10] for ln in lines] == ["1.67x*", "1.13x", "-"]
    assert HOST_NOTE.startswith("* host, run / calibration: calibrate does not time this policy's host step")
