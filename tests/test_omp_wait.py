"""OpenMP's wait policy for runs with CPU experts on a GPU (`cmoe.executor.omp_wait`): set before
torch loads, never over the user's own, and what a run records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmoe.executor import omp_wait

CMOE = Path(sys.executable).with_name("cmoe")
SET = "OMP_WAIT_POLICY=ACTIVE (set by cmoe: CPU experts beside a GPU)"
LEFT = "OpenMP's default wait policy (no CPU experts beside a GPU)"


@pytest.fixture
def clean(monkeypatch):
    for k in ("OMP_WAIT_POLICY", *omp_wait.USER_BIND):
        monkeypatch.setenv(k, "x")                      # so that its absence is restored afterwards
        monkeypatch.delenv(k)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)   # as in a fresh CLI process
    monkeypatch.setattr(omp_wait, "_READ", None)
    return monkeypatch


def test_sets_active_for_cpu_experts_on_a_gpu(clean):
    assert omp_wait.spin_threads("cuda", True) == SET
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert not {"OMP_PROC_BIND", "OMP_PLACES"} & set(os.environ)          # binding is the user's
    assert omp_wait.in_force() == "ACTIVE"


@pytest.mark.parametrize("device,cpu", [("cpu", True), ("cuda:0", False), ("cpu", False)])
def test_leaves_the_default_without_cpu_experts_beside_a_gpu(clean, device, cpu):
    assert omp_wait.spin_threads(device, cpu) == LEFT
    assert not {"OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES"} & set(os.environ)
    assert omp_wait.in_force() == "default"


def test_never_over_the_users_own(clean):
    """The user's wait policy stays; a binding of the user's is said and recorded, never set or
    changed by cmoe."""
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=PASSIVE as given"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_PROC_BIND" not in os.environ
    clean.delenv("OMP_WAIT_POLICY")
    clean.setenv("OMP_PLACES", "threads")
    assert omp_wait.spin_threads("cuda", True) == ("OMP_PLACES=threads as given; OMP_WAIT_POLICY=ACTIVE "
                                                   "(set by cmoe: CPU experts beside a GPU)")
    assert "OMP_PROC_BIND" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=ACTIVE, OMP_PLACES=threads as given"
    assert omp_wait.in_force() == "ACTIVE places=threads"


def test_for_policies_speaks_only_for_cpu_experts_beside_a_gpu(clean):
    """`for_policies`: what the CLI and `cmoe.execute` say, None where there is nothing to say."""
    assert omp_wait.for_policies("cuda", ["upper", "ondemand"]) is None
    assert omp_wait.for_policies("cpu", ["static"]) is None
    assert omp_wait.for_policies("cuda", []) is None and "OMP_WAIT_POLICY" not in os.environ
    assert omp_wait.for_policies("cpu", ["upper", "static"]) is None
    assert omp_wait.for_policies("cuda:1", ["upper", "lfu-fallback"]) == SET
    assert omp_wait.for_policies("cuda", ["static"]) == "OMP_WAIT_POLICY=ACTIVE as given"
    assert omp_wait.for_policies("cuda", ["upper"]) is not None     # GPU-only under the user's ACTIVE: said (below)


def test_for_policies_names_the_users_spinning_team_for_gpu_only_runs(clean):
    """The user's own `ACTIVE` for GPU-only policies on a GPU is said (it costs them), never changed;
    `PASSIVE`, a CPU device, or no policies say nothing."""
    clean.setenv("OMP_WAIT_POLICY", "active")
    assert omp_wait.for_policies("cuda", ["upper", "commit"]) == (
        "OMP_WAIT_POLICY=active as given spins OpenMP's threads for GPU-only policies, whose runs were "
        "0.7-1.3% slower under it (thirty-seventh session); unset it for them")
    assert os.environ["OMP_WAIT_POLICY"] == "active"
    assert omp_wait.for_policies("cpu", ["upper"]) is None
    assert omp_wait.for_policies("cuda", []) is None
    assert omp_wait.for_policies("cuda", ["upper", "static"]) == "OMP_WAIT_POLICY=active as given"
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_wait.for_policies("cuda", ["upper"]) is None


def test_refuses_once_torch_is_loaded(clean):
    clean.setitem(sys.modules, "torch", object())
    got = omp_wait.spin_threads("cuda", True)
    assert got == "torch was loaded before cmoe could set OMP_WAIT_POLICY=ACTIVE" and omp_wait.LATE in got
    assert "OMP_WAIT_POLICY" not in os.environ
    clean.setenv("OMP_PROC_BIND", "close")                 # the user's binding is said beside it
    assert omp_wait.spin_threads("cuda", True) == ("OMP_PROC_BIND=close as given; torch was loaded before "
                                                   "cmoe could set OMP_WAIT_POLICY=ACTIVE")
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")             # nothing left for cmoe to set: nothing late
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=PASSIVE, OMP_PROC_BIND=close as given"


def test_a_run_records_the_policy_libgomp_read_not_a_later_change(clean):
    clean.setenv("OMP_WAIT_POLICY", " active")             # libgomp reads it case aside
    clean.setenv("OMP_PROC_BIND", "Spread ")
    assert omp_wait.in_force() == "ACTIVE bind=spread"     # the first ask fixes it
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")             # too late for libgomp
    clean.setenv("OMP_PLACES", "cores")
    assert omp_wait.in_force() == "ACTIVE bind=spread"


def test_a_binding_without_a_policy_records_the_default_policy(clean):
    clean.setenv("OMP_PLACES", "cores")
    assert omp_wait.in_force() == "default places=cores"


def test_imported_after_torch_it_reads_the_variable_at_once(clean):
    """`cmoe.executor.run` imports the module after torch: the variables are taken then."""
    import importlib
    clean.setitem(sys.modules, "torch", object())
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")
    clean.setenv("OMP_PROC_BIND", "close")
    try:
        fresh = importlib.reload(omp_wait)
        clean.setenv("OMP_WAIT_POLICY", "ACTIVE")
        clean.delenv("OMP_PROC_BIND")
        assert fresh.in_force() == "PASSIVE bind=close"
    finally:
        clean.delitem(sys.modules, "torch")
        clean.delenv("OMP_WAIT_POLICY")
        importlib.reload(omp_wait)


def test_auto_is_told_by_the_driver_node(clean, tmp_path):
    clean.setattr(omp_wait, "NVIDIA_DEVICE", str(tmp_path / "nvidiactl"))
    assert not omp_wait.on_gpu("auto")
    assert omp_wait.spin_threads("auto", True) == LEFT
    (tmp_path / "nvidiactl").touch()
    assert omp_wait.on_gpu("auto") and omp_wait.on_gpu("cuda:1") and not omp_wait.on_gpu("cpu")
    for hidden in ("", "-1", " -1,0", "none", "x,1"):     # every GPU hidden: auto runs on the CPU
        clean.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not omp_wait.on_gpu("auto"), hidden
    for shown in ("0", "1,0", "GPU-8a3e", "MIG-1f2c,0", "0,-1"):
        clean.setenv("CUDA_VISIBLE_DEVICES", shown)
        assert omp_wait.on_gpu("auto"), shown
    assert omp_wait.spin_threads("auto", True) == SET


def _cli(args: list[str], env: dict) -> list[str]:
    """A fresh cmoe process that finds no GPU (hidden where there is one), so it stops with one line."""
    e = ({k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *omp_wait.USER_BIND)}
         | {"CUDA_VISIBLE_DEVICES": ""} | env)
    r = subprocess.run([str(CMOE), *args], capture_output=True, text=True, env=e, timeout=120, cwd=e.get("CWD"))
    assert r.returncode != 0
    return (r.stdout + r.stderr).splitlines()


NO_INPUT = "error: pass exactly one of --spec PRESET (random weights at its shapes) or --model DIR (a checkpoint)"
NO_GPU = "error: no CUDA GPU is visible here: pass --device cpu to run the same engine on the CPU"
EMBEDDED = "the embedded model (8 experts per layer) with 4 expert slots per layer (--slots to change)"


@pytest.mark.parametrize("policy,env,want", [
    ("static,upper", {}, [SET]),
    ("lfu-fallback", {"OMP_WAIT_POLICY": "PASSIVE", "OMP_PROC_BIND": "false"},
     ["OMP_WAIT_POLICY=PASSIVE, OMP_PROC_BIND=false as given"]),
    ("upper", {}, []),
])
def test_cmoe_execute_says_it_before_anything_else(policy, env, want):
    """A fresh `cmoe execute` process: the line comes before the input's own error (no --spec)."""
    assert _cli(["execute", "--device", "cuda", "--policy", policy], env) == want + [NO_INPUT]


def test_a_policy_file_decides_for_cmoe_execute(tmp_path):
    pj = tmp_path / "p.json"
    for pol, want in (("static", [SET]), ("ondemand", [])):
        pj.write_text(json.dumps({"format": "cmoe-policy", "policy": pol}))
        assert _cli(["execute", "--device", "cuda", "--policy-json", str(pj)], {}) == want + [NO_INPUT]
    pj.write_text("not json")                              # refused later, by the executor's own check
    assert _cli(["execute", "--device", "cuda", "--policy-json", str(pj)], {}) == [NO_INPUT]


def test_calibrate_spins_for_any_policy_and_cmoe_run_for_cpu_experts(tmp_path):
    """`cmoe calibrate` measures CPU experts for whatever policy uses its profile later, unless its
    `--policy` names GPU-only ones alone; `cmoe run` spins only for CPU-expert policies, calibrating
    or not: its calibration's CPU experts serve them alone, and a spinning team slowed GPU-only runs
    0.7-1.3% on a lent H100 (thirty-seventh session), so their host steps are measured and run as
    `cmoe execute` runs them."""
    env = {"CWD": str(tmp_path)}
    cal = ["calibrate", "--device", "cuda", "--out", str(tmp_path / "p.json")]
    assert _cli(cal, env) == [SET, NO_GPU]
    assert _cli(cal + ["--policy", "upper,commit"], env) == [NO_GPU]
    assert _cli(cal + ["--policy", "upper,lfu-fallback"], env) == [SET, NO_GPU]
    assert _cli(cal + ["--policy", "all"], env) == [SET, NO_GPU]
    assert _cli(cal + ["--policy", "uper"], env) == [
        "error: unknown policy 'uper': choose from upper, ondemand, lru-prefetch, lfu-fallback, static, commit, "
        "oracle, adaptive, adaptive-ahead, commit-ahead"]                 # before anything is set or measured
    assert _cli(["run", "--device", "cuda", "--policy", "upper"], env) == [EMBEDDED, NO_GPU]
    assert _cli(["run", "--device", "cuda", "--policy", "upper,static"], env) == [SET, EMBEDDED, NO_GPU]
    assert _cli(["run", "--device", "cuda", "--policy", "upper", "--profile", "h200"], env) == [EMBEDDED, NO_GPU]
    assert _cli(["run", "--device", "cuda", "--policy", "static", "--profile", "h200"], env) == [SET, EMBEDDED, NO_GPU]
    assert not (tmp_path / "cmoe-run").exists()            # nothing written by a run refused


def test_blank_variables_are_unset_and_values_stay_on_one_line(clean):
    """libgomp takes an empty variable as unset, and so does cmoe; a value's whitespace and line
    breaks do not reach the one-line answer."""
    clean.setenv("OMP_WAIT_POLICY", " ")
    clean.setenv("OMP_PROC_BIND", "")
    assert omp_wait.spin_threads("cuda", True) == SET
    assert omp_wait.in_force() == "ACTIVE"
    clean.setattr(omp_wait, "_READ", None)
    clean.setenv("GOMP_CPU_AFFINITY", "0-3\n")
    clean.setenv("OMP_WAIT_POLICY", "active\nx")
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=active x, GOMP_CPU_AFFINITY=0-3 as given"
    assert omp_wait.in_force() == "default affinity=0-3"       # libgomp: an unknown policy is the default


@pytest.mark.parametrize("env,want", [
    ({"OMP_WAIT_POLICY": "fast"}, "default"),                                 # libgomp: default, with a warning
    ({"OMP_WAIT_POLICY": "passive", "OMP_PROC_BIND": "FALSE ", "OMP_PLACES": "cores"}, "PASSIVE"),   # unbound
    ({"OMP_PROC_BIND": "spread, close", "GOMP_CPU_AFFINITY": "0-3"}, "default bind=spread,close affinity=0-3"),
    ({"OMP_PLACES": "Cores", "GOMP_CPU_AFFINITY": "1"}, "default places=cores"),   # places win over the list
    ({"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}, "default places=cores"),    # true beside places: the same
    ({"OMP_PROC_BIND": "true"}, "default bind=true"),
    ({"OMP_PROC_BIND": "master,close"}, "default bind=primary,close"),            # master: primary's old name
    ({"OMP_PROC_BIND": "false,close", "OMP_PLACES": "cores"}, "default places=cores"),   # refused: unset, places bind
    ({"OMP_PROC_BIND": "yes", "OMP_WAIT_POLICY": "Active"}, "ACTIVE"),             # refused: unset
    ({"OMP_PLACES": "{0:4}"}, "default places={0:4}"),
])
def test_the_record_is_what_libgomp_makes_of_the_variables(clean, env, want):
    for k, v in env.items():
        clean.setenv(k, v)
    assert omp_wait.in_force() == want == omp_wait.describe(env)


def test_a_bound_process_counts_its_cpus_from_before_libgomp_pins_its_first_thread():
    """Under OMP_PROC_BIND libgomp pins the first thread to the first place when torch loads it;
    `cores` (what the host's record counts) holds the mask from before, taken at import."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to see the mask narrow")
    code = ("import os\nfrom cmoe.executor import omp_wait\nimport torch\ntorch.ones(4).sum()\n"
            "print(len(os.sched_getaffinity(0)), omp_wait.cores(), omp_wait.in_force())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *omp_wait.USER_BIND)}
    env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": "threads"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["1", str(len(os.sched_getaffinity(0))), "default", "bind=close", "places=threads"]
