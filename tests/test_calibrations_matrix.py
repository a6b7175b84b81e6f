"""`benchmarks/calibrations_matrix.py`: every stored calibration predicts one grid, and each pair's
agreement is counted as issue 15's second condition counts it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from benchmarks.calibrations_matrix import agreement, grid, main, omp_record, read_head, table
from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200
from cmoe.core.spec import preset

RESULTS = {"spec": "mixtral-8x7b", "trace": "synthetic:mixtral-8x7b", "expert_format": "w4g128", "card": "test card",
           "commit": "abc1234", "calibrated_on": "built", "calibrate_s": 200.0, "configs": []}


def _folder(root: Path, name: str, profile, results=RESULTS, packed=True) -> Path:
    """A results folder as the GPU sessions leave it: head.tgz with results.json and profile.json."""
    d = root / name
    d.mkdir()
    files = {"results.json": json.dumps(results), "profile.json": json.dumps(profile.to_dict())}
    if not packed:
        for n, text in files.items():
            (d / n).write_text(text)
        return d
    with tarfile.open(d / "head.tgz", "w:gz") as t:
        for n, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(n)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return d


def test_read_head_unpacks_a_tarball_and_reads_plain_files(tmp_path):
    packed = _folder(tmp_path, "a", H200)
    plain = _folder(tmp_path, "b", H200, packed=False)
    res, prof = read_head(packed, tmp_path / "scratch")
    assert res == RESULTS and prof == tmp_path / "scratch" / "a" / "profile.json"
    assert json.loads(prof.read_text()) == H200.to_dict()
    assert read_head(plain, tmp_path / "scratch") == (RESULTS, plain / "profile.json")
    (tmp_path / "empty").mkdir()
    assert read_head(tmp_path / "empty", tmp_path / "scratch") is None


def test_a_slower_link_moves_the_loading_policy_and_not_the_resident_one(tmp_path):
    spec, src = preset("mixtral-8x7b"), "synthetic:mixtral-8x7b"
    pols = ["upper", "ondemand"]
    same = grid(H200, spec, src, "w4g128", [16.0], [1], pols, 4, tmp_path / "a")
    again = grid(H200, spec, src, "w4g128", [16.0], [1], pols, 4, tmp_path / "b")
    slow = grid(H200.link_scaled(0.5), spec, src, "w4g128", [16.0], [1], pols, 4, tmp_path / "c")
    assert set(same) == {(16.0, 1, "upper"), (16.0, 1, "ondemand")}
    assert same == again                                   # deterministic
    assert slow[16.0, 1, "upper"] == same[16.0, 1, "upper"]   # no loads: the link does not enter
    assert slow[16.0, 1, "ondemand"] < same[16.0, 1, "ondemand"] * 0.98
    pairs = agreement({"x": same, "y": again, "z": slow})
    assert [(p["a"], p["b"], p["within_2pct"], p["gpu_within_2pct"], p["rows"]) for p in pairs] == [
        ("x", "y", 2, 2, 2), ("x", "z", 1, 1, 2), ("y", "z", 1, 1, 2)]
    assert pairs[0]["worst"] == []
    d = slow[16.0, 1, "ondemand"] / same[16.0, 1, "ondemand"] - 1
    assert pairs[1]["worst"] == [[16.0, 1, "ondemand", d]]


def test_cpu_policies_count_in_all_rows_but_not_the_gpu_only_ones():
    preds = {"x": {(16.0, 1, "upper"): 100.0, (16.0, 1, "static"): 10.0},
             "y": {(16.0, 1, "upper"): 101.0, (16.0, 1, "static"): 12.0}}
    (p,) = agreement(preds, {"x": "ACTIVE"})
    assert (p["rows"], p["within_2pct"], p["gpu_rows"], p["gpu_within_2pct"]) == (2, 1, 1, 1)
    assert p["worst"] == [[16.0, 1, "static", pytest.approx(0.2)]]
    assert p["omp"] == ["ACTIVE", ""]                 # each calibration's OpenMP settings, "" unrecorded
    assert table([p]).splitlines()[2] == "| x | y | ACTIVE / unrecorded | 1 of 2 | 1 of 1 | pool 16 b1 static +20.0% |"


def test_folders_without_their_own_calibration_are_left_out_by_name(tmp_path, monkeypatch, capsys):
    from benchmarks.calibrations_matrix import own_calibration
    a = _folder(tmp_path, "a", H200)
    given = {k: v for k, v in RESULTS.items() if k not in ("calibrated_on", "calibrate_s")}
    c = _folder(tmp_path, "c", H200, given)                    # validate_h200.py --profile: calibrated elsewhere
    d = _folder(tmp_path, "d", H200, {k: v for k, v in RESULTS.items() if k != "spec"})
    monkeypatch.setattr("sys.argv", ["calibrations_matrix.py", str(a), str(c), str(d)])
    with pytest.raises(SystemExit) as e:
        main()
    assert "at least two folders" in str(e.value)
    err = capsys.readouterr().err
    assert f"left out {c}: its profile was given (--profile), not calibrated in that run" in err
    assert f"left out {d}: its results.json names no model (spec)" in err
    assert own_calibration({"calibrated_on": "cut"}) and own_calibration({"calibrate_built_s": 90.0})
    assert own_calibration({"calibrate_s": 90.0}) and not own_calibration(given)


def test_two_folders_of_one_name_are_refused(tmp_path, monkeypatch):
    a = _folder(tmp_path, "a", H200)
    (tmp_path / "x").mkdir()
    b = _folder(tmp_path / "x", "a", H200)
    monkeypatch.setattr("sys.argv", ["calibrations_matrix.py", str(a), str(b)])
    with pytest.raises(SystemExit, match="two folders are named a"):
        main()


def test_explain_names_the_group_that_separates_two_calibrations():
    from benchmarks.calibrations_matrix import GROUPS, explain, hybrid
    a, b = H200, H200.link_scaled(0.5).cpu_scaled(2.0)
    mixed = hybrid(a, b, "link")
    assert mixed.h2d_pinned == b.h2d_pinned and mixed.cpu_expert_gbps == a.cpu_expert_gbps
    assert set(GROUPS) == {"link", "host", "cpu", "gpu"}
    assert not set(GROUPS["gpu"]) & {f for g in ("link", "host", "cpu") for f in GROUPS[g]}
    from cmoe.core.hw_checks import WAIT_TABLES           # the host's tables read after a wait are the host's
    assert {t for t, _, _ in WAIT_TABLES} - {"cpu_wake_points"} <= set(GROUPS["host"])

    def sim(prof, tag):          # a stand-in grid: one GPU row priced by the link, one CPU row by the CPU
        return {(16.0, 1, "ondemand"): prof.h2d_pinned[-1][1], (16.0, 1, "static"): prof.cpu_expert_gbps}
    parts = explain(a, b, sim(b, "b"), sim)
    assert parts["alone"] == {"link": (1, 1), "host": (0, 0), "cpu": (1, 0), "gpu": (0, 0)}
    assert parts["without"] == {"link": (1, 0), "host": (2, 1), "cpu": (1, 1), "gpu": (2, 1)}


def test_a_calibration_without_the_cpu_layer_prices_only_the_gpu_rows(tmp_path):
    src = "measured by cmoe calibrate on a test card, 2026-12-06"
    blind = H200.__class__.from_dict({**H200.to_dict(), "sources": {"cpu_expert_gbps": src}})
    assert blind.cpu_layer_unmeasured()
    spec, trace = preset("mixtral-8x7b"), "synthetic:mixtral-8x7b"
    got = grid(blind, spec, trace, "w4g128", [16.0], [1], ["upper", "static"], 4, tmp_path / "a")
    full = grid(H200, spec, trace, "w4g128", [16.0], [1], ["upper", "static"], 4, tmp_path / "b")
    assert set(got) == {(16.0, 1, "upper")} and set(full) == {(16.0, 1, "upper"), (16.0, 1, "static")}
    for order in ({"blind": got, "full": full}, {"full": full, "blind": got}):   # either calibration first
        (p,) = agreement(order)
        assert (p["rows"], p["within_2pct"], p["gpu_rows"], p["gpu_within_2pct"], p["worst"]) == (1, 1, 1, 1, [])
    from benchmarks.calibrations_matrix import hybrid, within
    assert within(got, full) == (1, 1) and within(full, got) == (1, 1)
    measured = _with_cpu_layer(src)
    assert not hybrid(blind, measured, "host").cpu_layer_unmeasured()   # the host group brings cpu_lead_us, source too
    assert hybrid(measured, blind, "host").cpu_layer_unmeasured()       # ... and takes it away
    assert not hybrid(measured, blind, "link").cpu_layer_unmeasured()


def _with_cpu_layer(src: str):
    return H200.__class__.from_dict({**H200.to_dict(), "cpu_lead_us": 80.0,
                                     "sources": {"cpu_expert_gbps": src, "cpu_lead_us": src}})


def test_a_bad_number_list_is_one_line(tmp_path, monkeypatch):
    a, b = _folder(tmp_path, "a", H200), _folder(tmp_path, "b", H200)     # the CLI's own number lists
    monkeypatch.setattr("sys.argv", ["calibrations_matrix.py", str(a), str(b), "--pools", "16,20.5", "--batches", "1,x"])
    with pytest.raises(CmoeError, match=r"^--batches '1,x' is not a comma-separated list of numbers$"):
        main()
    from benchmarks.calibrations_matrix import numbers
    assert numbers("16,20.5", "--pools") == [16.0, 20.5] and numbers("1,8", "--batches", integer=True) == [1, 8]


def test_the_openmp_record_falls_back_to_the_runs_environment():
    """A profile from before it recorded OpenMP's settings: the environment validate_h200.py kept."""
    from dataclasses import replace
    assert omp_record(replace(H200, omp_wait_policy="default"), {"omp_env": {"OMP_WAIT_POLICY": "ACTIVE"}}) == "default"
    assert omp_record(H200, {"omp_env": {"OMP_WAIT_POLICY": "ACTIVE", "OMP_PLACES": "cores"}}) == "ACTIVE places=cores"
    assert omp_record(H200, {"omp_env": {}}) == "default"
    assert omp_record(H200, RESULTS) == ""                  # before results.json kept it: unrecorded


def test_main_names_each_calibrations_openmp_settings(tmp_path, monkeypatch, capsys):
    from dataclasses import replace
    a = _folder(tmp_path, "a", replace(H200, omp_wait_policy="default"))
    b = _folder(tmp_path, "b", H200, RESULTS | {"omp_env": {"OMP_WAIT_POLICY": "ACTIVE"}})
    monkeypatch.setattr("sys.argv", ["calibrations_matrix.py", str(a), str(b), "--pools", "16", "--batches", "1",
                                     "--policies", "upper", "--tokens", "4", "--out", str(tmp_path / "m.json")])
    main()
    assert "| a | b | default / ACTIVE | 1 of 1 | 1 of 1 | - |" in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "m.json").read_text())["pairs"][0]["omp"] == ["default", "ACTIVE"]
