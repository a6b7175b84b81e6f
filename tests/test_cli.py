"""The CLI end to end, and every bad input as one line with a non-zero exit and no partial output."""

from typer.testing import CliRunner

from cmoe import __version__
from cmoe.cli.app import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_and_version():
    assert run("--version").output.strip() == f"cmoe {__version__}"
    r = run("--help")
    assert r.exit_code == 0 and "trace" in r.output and "stats" in r.output


def test_synthetic_trace_then_stats(tmp_path):
    r = run("trace", "--synthetic", "mixtral-8x7b", "--out", tmp_path / "t", "--requests", 2, "--tokens", 20)
    assert r.exit_code == 0, r.output
    r = run("stats", tmp_path / "t", "--json", tmp_path / "s.json")
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0].startswith("mixtral-8x7b: 168 tokens (40 decode) in 2 requests")
    assert len([ln for ln in lines if ln[:5].strip().isdigit()]) == 32
    assert (tmp_path / "s.json").is_file()


def test_checkpoint_trace_then_stats(checkpoints, prompts, tmp_path):
    r = run("trace", "--model", checkpoints["olmoe"], "--data", prompts, "--out", tmp_path / "t",
            "--tokens", 3, "--device", "cpu", "--parquet")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t" / "routes.parquet").is_file()
    assert run("stats", tmp_path / "t").exit_code == 0


def _one_line_error(r, fragment):
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: ") and fragment in r.output
    assert "Traceback" not in r.output


def test_bad_inputs_give_one_line_and_no_output(tmp_path, prompts, checkpoints):
    out = tmp_path / "out"
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    _one_line_error(run("trace", "--model", tmp_path / "llama", "--data", prompts, "--out", out), "unsupported architecture 'llama'")
    _one_line_error(run("trace", "--model", tmp_path / "missing", "--data", prompts, "--out", out), "does not exist")
    pk = tmp_path / "pickle"
    pk.mkdir()
    (pk / "config.json").write_text((checkpoints["mixtral"] / "config.json").read_text())
    (pk / "pytorch_model.bin").write_bytes(b"\x80\x04")
    _one_line_error(run("trace", "--model", pk, "--data", prompts, "--out", out), "only pickle weights")
    _one_line_error(run("trace", "--synthetic", "gpt-9", "--out", out), "unknown model preset")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoints["mixtral"] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    _one_line_error(run("trace", "--model", broken, "--data", prompts, "--out", out), "could not load the checkpoint")
    _one_line_error(run("stats", tmp_path / "nope"), "does not exist")
    assert not out.exists()


def test_corrupted_and_out_of_range_bundles(tmp_path):
    from safetensors.numpy import load_file, save_file
    assert run("trace", "--synthetic", "olmoe-1b-7b", "--out", tmp_path / "t", "--requests", 1).exit_code == 0
    routes = tmp_path / "t" / "routes.safetensors"
    arrays = load_file(str(routes))
    arrays["experts"][0, 0, 0] = 200
    save_file(arrays, str(routes))
    _one_line_error(run("stats", tmp_path / "t"), "expert id 200 out of range 0..63")
    routes.write_bytes(b"garbage")
    _one_line_error(run("stats", tmp_path / "t"), "corrupted")


def test_existing_output_is_not_overwritten(tmp_path):
    assert run("trace", "--synthetic", "olmoe-1b-7b", "--out", tmp_path / "t", "--requests", 1).exit_code == 0
    before = (tmp_path / "t" / "meta.json").read_bytes()
    _one_line_error(run("trace", "--synthetic", "olmoe-1b-7b", "--out", tmp_path / "t", "--seed", 9), "already exists")
    assert (tmp_path / "t" / "meta.json").read_bytes() == before


def test_simulate_default_prints_one_row_per_policy(tmp_path):
    r = run("simulate", "--pool-gb", 20, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("mixtral-8x7b (w4a16), h200, pool 20 GB, batch 1")
    assert lines[1].startswith("every column over 1024 decode passes (1024 tokens); prefill apart")
    rows = {ln.split()[0]: ln.split() for ln in lines[3:10]}
    assert list(rows) == ["upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "oracle"]
    assert rows["upper"][2] == "1.00" and rows["upper"][5] == "1.000"
    assert all(float(v[2]) < 1 for k, v in rows.items() if k != "upper")
    import json
    pol = json.loads((tmp_path / "o" / "policy-commit.json").read_text())
    assert pol["policy"] == "commit" and pol["layout"]["slots"][0] >= 2
    from cmoe.core.timeline import COLUMNS, read_parquet
    spans = read_parquet(tmp_path / "o" / "timeline-commit.parquet")
    assert spans and len(spans[0]) == len(COLUMNS) and spans[0][0] == "sim"


def test_simulate_and_sweep_errors():
    _one_line_error(run("simulate", "--pool-gb", 4), "needs at least 2 slots")
    _one_line_error(run("simulate", "--policy", "magic"), "unknown policy 'magic'")
    _one_line_error(run("simulate", "--profile", "tpu9"), "unknown hardware profile 'tpu9'")
    _one_line_error(run("sweep", "--pool-gb", "x,y"), "not a comma-separated list")


def test_sweep_writes_one_table(tmp_path):
    r = run("sweep", "--pool-gb", "4,20", "--policy", "upper,commit", "--trace", "synthetic:olmoe-1b-7b",
            "--profile", "h200,rtx4090", "--jobs", 1, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 0, r.output
    import polars as pl
    df = pl.read_parquet(tmp_path / "s.parquet")
    assert df.height == 8 and set(df["policy"]) == {"upper", "commit"}
    ok = df.filter(pl.col("error") == "")
    assert (ok["tokens_per_s"] > 0).all()
