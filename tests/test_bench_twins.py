"""`benchmarks/lean_h200.py`'s twin runs: the A/B flags and `--env-ablation` become one list of
(variable, value, tag), checked before any model is built."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from benchmarks.lean_h200 import env_twins, phases_per_unit


def _args(env="", sync=False, inputs=False, wait=False):
    return SimpleNamespace(env_ablation=env, sync_ablation=sync, inputs_ablation=inputs, wait_ablation=wait)


def test_flags_and_env_pairs_make_one_list_in_order():
    ap = argparse.ArgumentParser()
    assert env_twins(_args(), ap) == []
    got = env_twins(_args("CMOE_ROUTE_MM=0,CMOE_GEMV=1", sync=True, wait=True), ap)
    assert got == [("CMOE_PASS_SYNC", "1", "synced passes"), ("CMOE_WAIT", "spin", "spin waits"),
                   ("CMOE_ROUTE_MM", "0", "CMOE_ROUTE_MM=0"), ("CMOE_GEMV", "1", "CMOE_GEMV=1")]
    assert env_twins(_args(inputs=True), ap) == [("CMOE_RUNTIME_INPUTS", "0", "torch pass inputs")]


@pytest.mark.parametrize("bad", ["CMOE_GEMV", "=1", "A=1,B"])
def test_a_pair_without_name_or_value_sign_stops_with_one_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        env_twins(_args(bad), argparse.ArgumentParser(prog="lean_h200.py"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lean_h200.py: error: --env-ablation:") and "is not NAME=VALUE" in err


def test_host_phases_are_read_per_layer_or_per_graphed_pass():
    """`phases_per_unit`: the Python step's profile per layer it counted (the run's totals where it
    counted none), `CMOE_HOST_PROFILE=pass` per graphed pass; the counters themselves are not phases."""
    ph = {"pass: inputs": 40.0, "read-back wait": 120.0, "layers": 4, "passes": 2}
    assert phases_per_unit(ph, "pass") == ("pass", {"pass: inputs": 20.0, "read-back wait": 60.0})
    assert phases_per_unit(ph, "1") == ("layer", {"pass: inputs": 10.0, "read-back wait": 30.0})
    assert phases_per_unit({"pass: head": 8.0, "passes": 2}, "1") == ("layer", {"pass: head": 8.0})
    assert phases_per_unit({"pass: head": 8.0}, "pass") == ("pass", {"pass: head": 8.0})


def test_validate_h200_reads_policies_before_torch_as_its_parser_does(monkeypatch, tmp_path):
    """`benchmarks/validate_h200.py` decides OpenMP's spinning from --policies before torch loads:
    the last one given, `=` or not, every policy without it; an abbreviation is refused by `main`'s
    parser, so the two never read different policies."""
    from benchmarks.validate_h200 import _named_policies, main
    from cmoe.policy.policies import POLICIES
    assert _named_policies([]) == list(POLICIES)
    assert _named_policies(["--out", "x", "--policies", "upper,ondemand", "--batches", "1"]) == ["upper", "ondemand"]
    assert _named_policies(["--policies=static"]) == ["static"]
    assert _named_policies(["--policies", "upper", "--policies", "static"]) == ["static"]
    assert _named_policies(["--pol", "static"]) == list(POLICIES)
    monkeypatch.setattr("sys.argv", ["validate_h200.py", "--out", str(tmp_path / "v"), "--pol", "static"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and not (tmp_path / "v").exists()


def test_validate_h200_with_a_profile_keeps_it_in_the_folder(monkeypatch, tmp_path):
    """`--profile` calibrates nothing and copies the profile into --out, which then predicts on its
    own (`gpu_session.sh validate` with PROFILE: batch 8 in a second call with the first call's
    calibration, forty-sixth session): the embedded model on the CPU, one policy, two tokens."""
    import json
    from benchmarks.validate_h200 import main
    from cmoe.core.hw import load_profile
    out = tmp_path / "v"
    monkeypatch.setattr("sys.argv", ["validate_h200.py", "--out", str(out), "--embedded", "--device", "cpu", "--slots", "4",
                                     "--profile", "h200", "--pools", "1", "--batches", "1", "--tokens", "2",
                                     "--policies", "upper", "--measure-only", "--commit", "test"])
    main()
    assert json.loads((out / "profile.json").read_text()) == load_profile("h200").to_dict()
    res = json.loads((out / "results.json").read_text())
    assert res["profile_from"] == "h200" and [c["batch"] for c in res["configs"]] == [1]
    assert not (out / "profile.measurements.json").exists()


def test_validate_h200_counts_the_compile_caches_it_starts_with(monkeypatch, tmp_path):
    """results.json says how warm Triton's and numba's caches were (a fresh machine's first
    calibration compiles every kernel): the files under TRITON_CACHE_DIR, numba's index files under
    NUMBA_CACHE_DIR; a cache directory that is not there counts 0."""
    from benchmarks.validate_h200 import compile_cache_files
    (tmp_path / "t" / "ab").mkdir(parents=True)
    for name in ("ab/k.cubin", "ab/k.json", "ab/__grp__k.json"):
        (tmp_path / "t" / name).write_bytes(b"x")
    (tmp_path / "n").mkdir()
    for name in ("host_program.plan-54.py311.nbi", "host_program.plan-54.py311.1.nbc", "x.py"):
        (tmp_path / "n" / name).write_bytes(b"x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "n"))
    assert compile_cache_files() == {"triton": 3, "numba": 1}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "none"))
    assert compile_cache_files() == {"triton": 0, "numba": 0}
