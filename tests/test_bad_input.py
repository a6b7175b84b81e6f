"""Bad input, table-driven, through the CLI: every case exits 2 with exactly one line that starts
`error:` and says what to do, before any work; nothing is written, an existing output is left
byte-identical, and an interrupted writer leaves neither half an output nor its temporary name.
Tiny inputs only (the embedded trace, one policy), so the whole file runs in seconds."""

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.data import default_model

runner = CliRunner()
MODEL = default_model()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line(r, fragment: str = "") -> str:
    assert r.exit_code == 2, r.output
    lines = r.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output and fragment in lines[0], lines[0]
    return lines[0]


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> Path:
    """A run folder of `cmoe simulate` (embedded trace, commit only), to copy and spoil."""
    out = tmp_path_factory.mktemp("sim") / "run"
    r = run("simulate", "--trace", "embedded", "--policy", "commit", "--out", out)
    assert r.exit_code == 0, r.output
    return out


# --- numbers out of range: refused at the boundary --------------------------------------------

SYN = ("trace", "--synthetic", "olmoe-1b-7b", "--requests", 1, "--tokens", 4)
NUMBERS = [
    (("simulate", "--pool-gb", "nan"), "invalid value for '--pool-gb': nan is not a finite number above 0"),
    (("simulate", "--pool-gb", "inf"), "inf is not a finite number above 0"),
    (("simulate", "--pool-gb", -3), "-3 is not a finite number above 0"),
    (("execute", "--pool-gb", "nan"), "nan is not a finite number above 0"),
    (("run", "--pool-gb", "nan"), "nan is not a finite number above 0"),
    ((*SYN, "--skew", "nan"), "invalid value for '--skew'"),
    ((*SYN, "--pred-acc", 1.5), "'--pred-acc'"),
    ((*SYN, "--seed", -1), "'--seed'"),
    ((*SYN, "--requests", 0), "'--requests'"),
    (("execute", "--seed", -1), "'--seed'"),
    (("simulate", "--batch", 100000), "'--batch'"),
    (("simulate", "--trace", "embedded", "--batch", 9), "the trace has 8 requests but batch 9 needs at least 9"),
    (("simulate", "--slots", 0), "'--slots'"),
    (("simulate", "--policy", ",,"), "--policy ',,' names no policy: choose from upper, ondemand"),
    (("simulate", "--policy", "commit,commit"), "--policy names commit twice"),
    (("execute", "--policy", ""), "--policy '' names no policy"),
    (("run", "--policy", ""), "--policy '' names no policy"),
    (("execute", "--tokens", 0), "'--tokens'"),
    (("trace", "--tokens", -1), "'--tokens'"),
    (("trace", "--max-prompt-tokens", 0), "'--max-prompt-tokens'"),
    (("quality", "--tokens", -5), "'--tokens'"),
    (("quality", "--variants", ",,"), "--variants ',,' gives no value"),
    (("sweep", "--pool-gb", "nan"), "--pool-gb has nan: give finite numbers above 0"),
    (("sweep", "--pool-gb", "20,-4"), "--pool-gb has -4"),
    (("sweep", "--pool-gb", ","), "--pool-gb ',' gives no value"),
    (("sweep", "--batch", "1.5"), "--batch has 1.5: give whole numbers above 0"),
    (("sweep", "--policy", ",,"), "names no policy"),
    (("sweep", "--trace", ","), "--trace ',' gives no value"),
    (("sweep", "--jobs", 0), "'--jobs'"),
    (("report", "x", "--max-spans", 0), "'--max-spans'"),
    (("run", "--repeat", 0), "'--repeat'"),
    (("simulate", "--bogus"), "no such option: --bogus"),
]


@pytest.mark.parametrize("args,fragment", NUMBERS, ids=[" ".join(map(str, a)) for a, _ in NUMBERS])
def test_bad_numbers_are_one_line(args, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line(run(*args), fragment)
    assert list(tmp_path.iterdir()) == []


def test_every_float_option_is_checked_finite(capsys):
    import typer

    from cmoe.cli.common import one_line_errors
    cmd = one_line_errors(lambda *, pool_gb, name: None)
    with pytest.raises(typer.Exit) as e:
        cmd(pool_gb=float("nan"), name="x")
    assert e.value.exit_code == 2
    assert capsys.readouterr().err == "error: --pool-gb nan is not a finite number: give a number like 20\n"


def test_decode_steps_past_the_models_positions(tmp_path):
    line = one_line(run("trace", "--tokens", 100_000_000, "--out", tmp_path / "t"))
    assert line == ("error: --tokens 100000000 runs past the model's max_position_embeddings (1024): "
                    "give at most 1023 (less the prompt's tokens)")
    assert not (tmp_path / "t").exists()


# --- outputs: every writer, checked before any work --------------------------------------------

WRITERS = {    # command -> (its arguments with the output last, the output's option, is it a folder)
    "trace": ((*SYN, "--out"), "--out", True),
    "stats": (("stats", "embedded", "--json"), "--json", False),
    "simulate": (("simulate", "--trace", "embedded", "--policy", "commit", "--out"), "--out", True),
    "sweep": (("sweep", "--trace", "embedded", "--policy", "commit", "--pool-gb", 20, "--jobs", 1, "--out"),
              "--out", False),
    "execute": (("execute", "--model", MODEL, "--trace", "embedded", "--device", "cpu", "--tokens", 2, "--out"),
                "--out", True),
    "report": (("report", "nope", "--out"), "--out", False),
    "report --chrome": (("report", "nope.parquet", "--chrome"), "--chrome", False),
    "validate": (("validate", "p", "m", "--out"), "--out", False),
    "run": (("run", "--device", "cpu", "--profile", "h200", "--tokens", 2, "--out"), "--out", True),
    "quality": (("quality", "--tokens", 4, "--out"), "--out", False),
}


@pytest.mark.parametrize("cmd", list(WRITERS))
def test_output_under_a_file(cmd, tmp_path):
    args, flag, _ = WRITERS[cmd]
    (tmp_path / "file").write_bytes(b"keep")
    out = tmp_path / "file" / "x"
    line = one_line(run(*args, out))
    assert line == f"error: cannot write {out}: {tmp_path / 'file'} is a file, not a folder: choose another {flag}"
    assert (tmp_path / "file").read_bytes() == b"keep" and sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.parametrize("cmd", list(WRITERS))
def test_output_in_a_read_only_folder(cmd, tmp_path):
    args, flag, _ = WRITERS[cmd]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user (root) writes into read-only folders")
        line = one_line(run(*args, ro / "x"))
        assert line == f"error: cannot write {ro / 'x'}: {ro} is not writable: choose another {flag}"
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("cmd", list(WRITERS))
def test_existing_output_is_refused_and_kept(cmd, tmp_path):
    args, flag, folder = WRITERS[cmd]
    out = tmp_path / "x"
    if folder:
        out.mkdir()
        (out / ("meta.json" if cmd == "trace" else "metrics.json")).write_bytes(b"keep")
    else:
        out.write_bytes(b"keep")
    line = one_line(run(*args, out))
    assert line == f"error: {out} already exists: choose another {flag} or pass --force to replace it"
    if folder:
        assert os.listdir(out) == [("meta.json" if cmd == "trace" else "metrics.json")]
        out = out / os.listdir(out)[0]
    assert out.read_bytes() == b"keep" and hidden(tmp_path) == []


def test_force_replaces_a_run_folder_whole(sim_run, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(sim_run, out)
    (out / "notes.txt").write_text("stale")
    r = run("simulate", "--trace", "embedded", "--policy", "upper", "--out", out, "--force")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["metrics.json", "passes-upper.json", "policy-upper.json", "report.html",
                                       "timeline-upper.json", "timeline-upper.parquet"]
    assert [m["policy"] for m in json.loads((out / "metrics.json").read_text())] == ["upper"]
    assert hidden(tmp_path) == []


def test_force_does_not_replace_a_folder_cmoe_did_not_write(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    line = one_line(run("simulate", "--trace", "embedded", "--policy", "commit", "--out", out, "--force"))
    assert line == (f"error: {out} is not an output of cmoe (it has no metrics.json), so --force does not replace it: "
                    f"choose another --out or remove it yourself")
    assert os.listdir(out) == ["thesis.tex"]


# --- interrupted writers leave nothing ----------------------------------------------------------

def test_atomic_dir_leaves_nothing_when_the_writer_fails(tmp_path):
    from cmoe.core.util import atomic_dir
    with pytest.raises(ValueError):
        with atomic_dir(tmp_path / "o") as tmp:
            (tmp / "a.json").write_text("{}")
            raise ValueError("midway")
    assert os.listdir(tmp_path) == []
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "metrics.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "o", force=True, marker=("metrics.json",)) as tmp:
            (tmp / "metrics.json").write_text("new")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["o"] and (tmp_path / "o" / "metrics.json").read_text() == "old"


def test_a_dead_writers_temporary_folder_is_cleared(tmp_path):
    from cmoe.core.util import atomic_dir
    (tmp_path / ".o.tmp-999999999").mkdir()            # no such process: killed long ago
    with atomic_dir(tmp_path / "o") as tmp:
        (tmp / "metrics.json").write_text("[]")
    assert os.listdir(tmp_path) == ["o"]


def test_interrupted_simulate_keeps_nothing(tmp_path, monkeypatch):
    import cmoe.report.chrome as chrome
    real, calls = chrome.write_chrome_trace, []

    def second_call_interrupted(spans, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(spans, path)
    monkeypatch.setattr(chrome, "write_chrome_trace", second_call_interrupted)
    r = run("simulate", "--trace", "embedded", "--policy", "upper,commit", "--out", tmp_path / "o")
    assert r.exit_code == 130 and r.output.splitlines()[-1] == "interrupted; nothing partial was kept"
    assert len(calls) == 2 and os.listdir(tmp_path) == []


def test_interrupted_trace_parquet_keeps_nothing(tmp_path, monkeypatch):
    import cmoe.trace.tables as tables

    def interrupted(t, path):
        Path(path).write_bytes(b"PAR1")
        raise KeyboardInterrupt
    monkeypatch.setattr(tables, "write_routes_parquet", interrupted)
    r = run(*SYN, "--parquet", "--out", tmp_path / "t")
    assert r.exit_code == 130 and os.listdir(tmp_path) == []


def test_interrupted_run_keeps_neither_predicted_nor_measured(tmp_path, monkeypatch):
    import cmoe.executor.run as ex

    def interrupted(w, cfg):
        assert (tmp_path / f".o.tmp-{os.getpid()}" / "predicted" / "metrics.json").is_file()
        raise KeyboardInterrupt
    monkeypatch.setattr(ex, "build", lambda w, cfg: None)
    monkeypatch.setattr(ex, "execute", interrupted)
    r = run("run", "--device", "cpu", "--profile", "h200", "--tokens", 2, "--out", tmp_path / "o")
    assert r.exit_code == 130, r.output
    assert os.listdir(tmp_path) == []


# --- report and validate on inputs that are not what they expect --------------------------------

def _timeline_like(path: Path, **cols):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(cols), path)


SPOILED = [     # (file of the run folder, what to write there, the message; validate's where it differs)
    ("metrics.json", b"", "has no readable metrics.json", None),
    ("metrics.json", b"[]", "metrics.json is not a list of per-policy metrics", None),
    ("metrics.json", b"[1, 2]", "metrics.json is not a list of per-policy metrics", None),
    ("metrics.json", b'{"policy": "commit"}', "metrics.json is not a list of per-policy metrics", None),
    ("metrics.json", b'[{"policy": "commit"}]', "metrics.json: policy commit lacks model, pool_gb, batch",
     "used live routing"),                      # validation compares the setup with what is there
    ("metrics.json", b'[{"policy": "../x"}]', "has an entry without a policy name", None),
    ("timeline-commit.parquet", b"not parquet", "timeline-commit.parquet is not a readable Parquet file", None),
    ("timeline-commit.parquet", {"a": [1], "b": [2]}, "timeline-commit.parquet is not a timeline: column source", None),
    ("passes-commit.json", b"{", "passes-commit.json is not readable JSON", None),
    ("passes-commit.json", b"[1]", "passes-commit.json is not a list of passes with pass, decode, tokens, us", None),
]


@pytest.mark.parametrize("name,content,fragment,fragment_validate", SPOILED,
                         ids=[f"{n}={c!r}"[:40] for n, c, _, _ in SPOILED])
def test_report_and_validate_refuse_a_spoiled_run_folder(name, content, fragment, fragment_validate, sim_run,
                                                         tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sim_run, bad)
    if isinstance(content, dict):
        _timeline_like(bad / name, **content)
    else:
        (bad / name).write_bytes(content)
    one_line(run("report", bad, "--out", tmp_path / "r.html"), fragment)
    one_line(run("validate", bad, bad, "--out", tmp_path / "v.json"), fragment_validate or fragment)
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_report_refuses_files_that_are_not_its_tables(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"junk")
    one_line(run("report", tmp_path / "junk.parquet"), "junk.parquet is not a readable Parquet file")
    _timeline_like(tmp_path / "other.parquet", a=[1], b=["x"])
    line = one_line(run("report", tmp_path / "other.parquet"))
    assert line == (f"error: {tmp_path / 'other.parquet'} is neither a timeline nor a sweep table (cmoe sweep --out): "
                    f"it lacks batch, error, policy, pool_gb, profile, tokens_per_s, trace")
    from cmoe.core.timeline import COLUMNS
    _timeline_like(tmp_path / "typed.parquet", **{c: ["1"] for c in COLUMNS})
    one_line(run("report", tmp_path / "typed.parquet"),
             "typed.parquet is not a timeline: column step is missing or of another type")
    one_line(run("report", tmp_path / "other.parquet", "--chrome", tmp_path / "c.json"),
             "other.parquet is not a timeline")
    _timeline_like(tmp_path / "empty.parquet", **{c: [] for c in ("trace", "profile", "batch", "policy", "pool_gb",
                                                                 "tokens_per_s", "error")})
    one_line(run("report", tmp_path / "empty.parquet"), "empty.parquet has no rows")
    (tmp_path / "x.json").write_text("[]")
    one_line(run("report", tmp_path / "x.json"), "expected a run folder, a sweep or timeline .parquet file")
    assert not any(p.suffix in (".html", ".json") and p.name != "x.json" for p in tmp_path.iterdir())


# --- memory and sweeps --------------------------------------------------------------------------

def test_out_of_memory_says_how_much_and_what_to_do(tmp_path, monkeypatch):
    import cmoe.sim.api as api

    def exhausted(*a, **k):
        raise MemoryError
    monkeypatch.setattr(api, "run_policies", exhausted)
    line = one_line(run("simulate", "--trace", "embedded", "--policy", "upper,commit"))
    assert line == ("error: out of memory: simulating 1,792 tokens x 8 MoE layers x 2 policies needs about 0.1 GB: "
                    "simulate a shorter trace (fewer requests or decode steps) or fewer --policy names")
    line = one_line(run("simulate", "--trace", "embedded", "--policy", "upper,commit", "--out", tmp_path / "o"))
    assert line.endswith("needs about 0.2 GB (0.1 GB without --out): simulate a shorter trace (fewer requests or "
                         "decode steps) or fewer --policy names, or drop --out")
    assert os.listdir(tmp_path) == []


def test_a_sweep_where_every_point_fails_says_why_and_writes_nothing(tmp_path):
    out = tmp_path / "s.parquet"
    line = one_line(run("sweep", "--trace", "embedded", "--pool-gb", "0.001,0.002", "--policy", "commit",
                        "--jobs", 1, "--out", out))
    assert line.startswith("error: none of the 2 grid points could run; the first (embedded, h200, pool 0.001 GB, "
                           "commit, batch 1): a 0.00 GB pool cannot hold tiny-moe's resident weights")
    assert os.listdir(tmp_path) == []
