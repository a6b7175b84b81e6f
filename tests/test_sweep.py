"""`cmoe sweep` without Ray: points from a grid or a file, the table streamed and resumed, every
point's exception kept in its row. Tiny points on the embedded trace, so the file runs in seconds."""

import json

import polars as pl
import pytest
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.core.errors import CmoeError
from cmoe.sweep import grid, normalise, point_id, points_file, read_points, run_point, sweep

TINY = {"trace": "embedded", "slots": 4, "groups": 1}


def tiny_points(n):
    pols = ["upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "oracle"]
    return [normalise({**TINY, "policy": pols[i % 7], "decode_steps": 1 + i // 7}) for i in range(n)]


def test_a_point_from_a_file_has_the_id_of_the_same_grid_point(tmp_path):
    (tmp_path / "p.yaml").write_text("- {trace: embedded, policy: commit, pool_gb: 16}\n- {policy: oracle, batch: 2}\n")
    (tmp_path / "p.json").write_text(json.dumps({"points": [{"trace": "embedded", "policy": "commit", "pool_gb": 16},
                                                            {"policy": "oracle", "batch": 2}]}))
    (tmp_path / "p.csv").write_text("trace,policy,pool_gb,batch\nembedded,commit,16,\n,oracle,,2\n")
    got = [read_points(tmp_path / f) for f in ("p.yaml", "p.json", "p.csv")]
    assert got[0] == got[1] == got[2]
    assert got[0][1] == {"trace": "synthetic:mixtral-8x7b", "profile": "h200", "quant": None, "policy": "oracle",
                         "pool_gb": 20.0, "batch": 2, "slots": None, "include_prefill": True, "groups": None,
                         "decode_steps": None, "engine": "replay"}
    [g] = grid(["embedded"], ["h200"], [16.0], ["commit"], [1])
    assert point_id(got[0][0]) == point_id(g) == point_id({"trace": "embedded", "policy": "commit", "pool_gb": 16})


def test_bad_points_files_are_one_line(tmp_path):
    cases = {"a.yaml": ("- {policy: commit, colour: red}\n", "point 1 has an unknown setting 'colour'"),
             "b.json": ('[{"batch": 1.5}]', "point 1: batch is 1.5, not a whole number"),
             "c.csv": ("policy,include_prefill\ncommit,maybe\n", "include_prefill is 'maybe', not true or false"),
             "d.yaml": ("policy: [\n", "is not valid YAML"), "e.json": ("[]", "holds no points"),
             "f.txt": ("x", "points files end in .yaml, .yml, .json or .csv")}
    for name, (text, fragment) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(CmoeError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
            read_points(tmp_path / name)
    with pytest.raises(CmoeError, match="does not exist"):
        read_points(tmp_path / "none.yaml")
    with pytest.raises(CmoeError, match="with --points, --pool-gb gives what a point leaves out, so one value"):
        points_file(tmp_path / "a.yaml", {"pool_gb": [12.0, 16.0]})


def test_grid_options_fill_what_a_point_leaves_out(tmp_path):
    (tmp_path / "p.yaml").write_text("- {policy: commit}\n- {policy: oracle, pool_gb: 12}\n")
    a, b = points_file(tmp_path / "p.yaml", {"trace": ["embedded"], "pool_gb": [16.0]}, quant="w8a16")
    assert (a["trace"], a["pool_gb"], a["quant"]) == ("embedded", 16.0, "w8a16") and b["pool_gb"] == 12.0


def test_an_unexpected_exception_is_kept_in_its_row(monkeypatch):
    import cmoe.sim.run as run

    def boom(*a, **k):
        raise ValueError("the pool\nbroke")
    monkeypatch.setattr(run, "simulate", boom)
    row = run_point(normalise(TINY))
    assert row["error"] == "ValueError: the pool broke" and "Traceback" in row["traceback"]
    assert row["point_id"] == point_id(TINY) and "tokens_per_s" not in row


def test_an_interrupted_sweep_keeps_finished_points_and_resumes_without_them(tmp_path):
    out, pts = tmp_path / "s.parquet", tiny_points(30)

    def stop_after(n):
        def on_row(row, stats):
            if stats.computed == n:
                raise KeyboardInterrupt
        return on_row
    with pytest.raises(KeyboardInterrupt):
        sweep(pts, out, jobs=1, progress=False, on_row=stop_after(12))
    first = pl.read_parquet(out)
    assert first.height == 12 and (first["error"] == "").all()
    stats = sweep(pts, out, jobs=1, resume=True, progress=False)
    assert (stats.points, stats.skipped, stats.computed, stats.failed) == (30, 12, 18, 0)
    df = pl.read_parquet(out)
    assert df["point_id"].to_list() == [point_id(p) for p in pts]              # in the points' order
    assert df.head(12).equals(first)                                             # the finished rows, untouched
    again = sweep(pts, out, jobs=1, resume=True, progress=False)
    assert (again.skipped, again.computed) == (30, 0)


def test_retry_errors_runs_the_failed_points_again(tmp_path):
    out = tmp_path / "s.parquet"
    pts = [normalise({**TINY, "policy": "commit"}), normalise({**TINY, "trace": str(tmp_path / "missing")})]
    s = sweep(pts, out, jobs=1, progress=False)
    assert (s.computed, s.failed) == (2, 1)
    assert sweep(pts, out, jobs=1, resume=True, progress=False).computed == 0
    s = sweep(pts, out, jobs=1, resume=True, retry_errors=True, progress=False)
    assert (s.skipped, s.computed, s.failed) == (1, 1, 1)


def test_local_worker_processes_give_the_same_rows_as_one_process(tmp_path):
    pts = tiny_points(14)
    sweep(pts, tmp_path / "a.parquet", jobs=1, progress=False)
    sweep(pts, tmp_path / "b.parquet", jobs=2, progress=False)
    a, b = (pl.read_parquet(tmp_path / f).drop("wall_s") for f in ("a.parquet", "b.parquet"))
    assert a.equals(b)


runner = CliRunner()


def test_cli_sweep_from_a_points_file_and_resumed(tmp_path):
    (tmp_path / "p.csv").write_text("policy,slots,decode_steps,include_prefill\ncommit,4,3,false\noracle,3,2,\n")
    out = tmp_path / "s.parquet"
    args = ["sweep", "--points", str(tmp_path / "p.csv"), "--trace", "embedded", "--jobs", "1", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == f"wrote {out}: 2 points run"
    df = pl.read_parquet(out)
    assert df["policy"].to_list() == ["commit", "oracle"] and df["include_prefill"].to_list() == [False, True]
    assert df["decode_tokens"].to_list() == [8 * 3, 8 * 2] and (df["error"] == "").all()     # 8 groups
    r = runner.invoke(app, args + ["--resume"])
    assert r.exit_code == 0 and r.output.splitlines()[0] == f"wrote {out}: 0 points run, 2 already there"
    r = runner.invoke(app, args + ["--resume", "--force"])
    assert r.exit_code == 2 and "--resume keeps the points in --out and --force replaces it" in r.output
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "already exists" in r.output
