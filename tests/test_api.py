"""The Python API gives what the CLI gives."""

import json
import subprocess
import sys

import pytest

import cmoe


def test_import_cmoe_loads_nothing_heavy():
    code = "import sys, cmoe; print(sorted(m for m in ('torch', 'simpy', 'polars', 'cmoe.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_simulate_equals_the_cli_row(tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    rows = cmoe.simulate("embedded", pool_gb=20, policies=["ondemand", "oracle"], slots=4)
    assert [r.metrics["policy"] for r in rows] == ["ondemand", "oracle"]
    r = CliRunner().invoke(app, ["simulate", "--trace", "embedded", "--policy", "ondemand,oracle", "--slots", "4",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    cli = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert [x.metrics for x in rows] == cli


def test_execute_on_the_cpu_and_bad_names():
    from cmoe.data import default_model
    res = cmoe.execute(model=default_model(), trace="embedded", policies=["upper", "oracle"], tokens=2,
                       device="cpu", slots=4)
    assert [r.metrics["decode_tokens"] for r in res] == [2, 2] and res[1].metrics["fallbacks"] == 0
    with pytest.raises(cmoe.CmoeError, match="unknown policy 'fastest'"):
        cmoe.simulate("embedded", policies="fastest")
    with pytest.raises(AttributeError):
        cmoe.nothing_here


def test_execute_spins_openmp_threads_for_cpu_experts_before_torch_as_the_cli_does():
    """In a fresh process, `cmoe.execute` with a CPU-expert policy on a GPU device sets
    OMP_WAIT_POLICY=ACTIVE while torch is not loaded yet (here it then finds no GPU: one
    CmoeError), and binds nothing; with GPU-only policies, or where the user set it, it leaves it;
    with torch loaded first it warns, unless the user had set it; a bad policy name is the same
    one-line error as before."""
    import os
    pytest.importorskip("torch")
    code = ("import os, sys, warnings, cmoe\n"
            "from cmoe.executor import omp_wait\n"
            "spin = omp_wait.for_policies\n"
            "def watched(*a):\n"
            "    print('torch loaded' if 'torch' in sys.modules else 'no torch', end=' | ')\n"
            "    return spin(*a)\n"
            "omp_wait.for_policies = watched\n"
            "if %r:\n"
            "    import torch\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    try:\n"
            "        cmoe.execute(spec='mixtral-8x7b', trace='synthetic:mixtral-8x7b', policies=%r, device='cuda')\n"
            "    except cmoe.CmoeError as e:\n"
            "        print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('OMP_PROC_BIND'), '|', e, '|',\n"
            "              [str(x.message) for x in w])\n")
    from cmoe.executor.omp_wait import USER_BIND
    env = ({k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *USER_BIND)}
           | {"CUDA_VISIBLE_DEVICES": ""})
    no_gpu = "no CUDA GPU is visible here: pass --device cpu to run the same engine on the CPU"
    late = "cmoe.execute: torch was loaded before cmoe could set OMP_WAIT_POLICY=ACTIVE: set it before importing torch"
    for first, pols, given, want in ((False, ["static"], None, f"no torch | ACTIVE None | {no_gpu} | []"),
                                     (False, ["upper", "ondemand"], None, f"no torch | None None | {no_gpu} | []"),
                                     (False, "all", "PASSIVE", f"no torch | PASSIVE None | {no_gpu} | []"),
                                     (True, ["static"], None, f"torch loaded | None None | {no_gpu} | [{late!r}]"),
                                     (True, ["static"], "PASSIVE", f"torch loaded | PASSIVE None | {no_gpu} | []")):
        e = env | ({"OMP_WAIT_POLICY": given} if given else {})
        out = subprocess.run([sys.executable, "-c", code % (first, pols)], capture_output=True, text=True, env=e,
                             timeout=120).stdout
        assert out.strip() == want, out
    with pytest.raises(cmoe.CmoeError, match="^unknown policy 'fastest': choose from upper, "):
        cmoe.execute(spec="mixtral-8x7b", trace="synthetic:mixtral-8x7b", policies="fastest", device="cpu")
