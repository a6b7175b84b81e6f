"""`benchmarks/validate_table.py`'s table: the host column marks the policies whose host step
calibrate does not time (`cmoe.pipeline.host_timed`)."""

from __future__ import annotations

import pytest

from benchmarks.validate_table import HOST_NOTE, table, unpacked
from cmoe.pipeline import host_timed


def _row(policy: str, host: float | None) -> dict:
    return {"pool_gb": 20.0, "experts_fit": 176, "batch": 1, "policy": policy, "predicted_tok_s": 100.0,
            "measured_tok_s": [99.0], "error": 0.0101, "spread": 0.0, "predicted_tpot_ms": 10.0,
            "measured_tpot_ms": 10.1, "layer_mean_error_worst": [0.02], "layer_worst": [3],
            "layer_mape_mean": [0.01], "host_speed": [host], "link_speed": [], "slow_loads": []}


def test_the_host_column_stars_what_calibrate_does_not_time():
    assert [host_timed(p) for p in ("upper", "commit", "commit-ahead", "ondemand", "oracle", "static")] == [
        False, False, False, True, True, True]
    rows = [_row("upper", 1.67), _row("ondemand", 1.13), _row("commit", None)]
    rows[1]["boundary_speed"], rows[2]["boundary_speed"] = [1.8123, None], [0.55]
    lines = table(rows).splitlines()[2:]
    assert [ln.split(" | ")[10] for ln in lines] == ["1.67x*", "1.13x", "-"]
    assert [ln.split(" | ")[12] for ln in lines] == ["- |", "1.81x / - |", "0.55x |"]   # the pass boundary
    assert HOST_NOTE.startswith("* host, run / calibration: calibrate does not time this policy's host step")


def _tar(path, files: dict) -> None:
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_folder_as_the_device_brings_it_back_is_unpacked_beside_it(tmp_path):
    came = tmp_path / "came"
    came.mkdir()
    _tar(came / "head.tgz", {"results.json": "{}", "profile.json": "{\"name\": \"p\"}"})
    _tar(came / "meas-b8.tgz", {"pool20-b8/measured/run.json": "[1]"})
    got = unpacked(came, tmp_path / "work")
    assert got == tmp_path / "work" / "unpacked"
    assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()) == [
        "pool20-b8/measured/run.json", "profile.json", "results.json"]
    assert sorted(p.name for p in came.iterdir()) == ["head.tgz", "meas-b8.tgz"]
    (got / "stale").write_text("x")
    assert not (unpacked(came, tmp_path / "work") / "stale").exists()
    assert unpacked(got, tmp_path / "other") == got


def test_a_folder_without_results_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        unpacked(tmp_path, tmp_path / "work")
    assert str(e.value) == (f"validate_table.py: {tmp_path} holds neither results.json nor head.tgz: give the folder "
                            "benchmarks/validate_h200.py wrote, or the one gpu_session.sh validate brought back")
    with pytest.raises(SystemExit) as e:                  # another script that reads the folder names itself
        unpacked(tmp_path, tmp_path / "work", "boundary_states.py")
    assert str(e.value).startswith(f"boundary_states.py: {tmp_path} holds neither")


def test_a_folder_without_its_measured_runs_is_refused_before_any_summary(tmp_path, monkeypatch):
    """A stored folder keeps head.tgz alone: read in place, it must not overwrite its summary with
    none (a helper's review found it did)."""
    import json
    import sys
    from benchmarks import validate_table
    came = tmp_path / "stored"
    came.mkdir()
    res = {"configs": [{"pool_gb": 20.0, "batch": 8, "policies": ["upper"], "experts_fit": 172}],
           "spec": "mixtral-8x7b", "tokens": 4}
    _tar(came / "head.tgz", {"results.json": json.dumps(res)})
    (came / "summary.json").write_text("kept")
    monkeypatch.setattr(sys, "argv", ["validate_table.py", str(came), "--work", str(tmp_path / "w"), "--profile", "h200"])
    with pytest.raises(SystemExit) as e:
        validate_table.main()
    assert str(e.value) == (f"validate_table.py: {tmp_path / 'w' / 'unpacked' / 'pool20-b8'} has no measured runs: give "
                            "the folder with meas-b8.tgz (or its pool*-b8 folders) beside head.tgz")
    assert (came / "summary.json").read_text() == "kept"


def test_the_cpu_loop_is_read_against_the_runs_host_speed():
    """`cpu_ref_reading`: the runs' range of the CPU's loop over its calibration, and its r against
    their host speed where three runs or more have both; nothing where none recorded it."""
    from benchmarks.validate_table import cpu_ref_reading
    rows = [_row("ondemand", h) for h in (1.0, 1.5, 2.0, None)]
    for r, k in zip(rows, ([1.0], [1.4], [2.2], [3.0])):
        r["cpu_ref"] = k
    assert cpu_ref_reading(rows) == ("the host CPU's plain loop (`cmoe.core.cpu_ref`) took 1.00-3.00x its calibrated "
                                     "time around the runs (r 0.98 with their host's time a layer over its "
                                     "calibration, 3 runs)")
    assert cpu_ref_reading(rows[:2]) == ("the host CPU's plain loop (`cmoe.core.cpu_ref`) took 1.00-1.40x its "
                                         "calibrated time around the runs")
    assert cpu_ref_reading([_row("ondemand", 1.0)]) is None                  # runs from before it


def test_the_tally_counts_the_rows_at_the_cpu_loops_speed():
    """`--cpu-ref-adjust`'s rows are counted beside the others, a row without it as it is."""
    from benchmarks.validate_table import counts
    rows = [_row("ondemand", 1.2), _row("oracle", 1.1), _row("upper", None)]
    rows[0]["error"], rows[0]["cpu_ref_adjusted_error"] = 0.06, 0.02
    rows[1]["error"], rows[1]["cpu_ref_adjusted_error"] = 0.02, 0.04
    line = counts(rows)
    assert line.startswith("3 configurations: 2 within 3%, 2 within 5%, 3 within 10%; every layer within 8% in 3")
    assert line.endswith("; with the host at the CPU loop's speed around its runs (the rows without it as they are) "
                         "2 / 3 / 3")
