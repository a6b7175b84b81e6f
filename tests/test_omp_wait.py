"""OpenMP's wait policy for runs with CPU experts on a GPU (`cmoe.executor.omp_wait`): set before
torch loads, never over the user's own, and what a run records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmoe.executor import omp_wait

CMOE = Path(sys.executable).with_name("cmoe")


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)   # as in a fresh CLI process
    return monkeypatch


def test_sets_active_for_cpu_experts_on_a_gpu(clean):
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=ACTIVE (set by cmoe: CPU experts beside a GPU)"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert omp_wait.in_force() == "ACTIVE"


@pytest.mark.parametrize("device,cpu", [("cpu", True), ("cuda:0", False), ("cpu", False)])
def test_leaves_the_default_without_cpu_experts_beside_a_gpu(clean, device, cpu):
    assert omp_wait.spin_threads(device, cpu) == "OpenMP's default wait policy (no CPU experts beside a GPU)"
    assert "OMP_WAIT_POLICY" not in os.environ
    assert omp_wait.in_force() == "default"


def test_never_over_the_users_own(clean):
    clean.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_wait.spin_threads("cuda", True) == "OMP_WAIT_POLICY=PASSIVE as given"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_refuses_once_torch_is_loaded(clean):
    clean.setitem(sys.modules, "torch", object())
    got = omp_wait.spin_threads("cuda", True)
    assert got == "OpenMP's default wait policy (torch was loaded before cmoe could set OMP_WAIT_POLICY)"
    assert "OMP_WAIT_POLICY" not in os.environ


def test_auto_is_told_by_the_driver_node(clean, tmp_path):
    clean.setattr(omp_wait, "NVIDIA_DEVICE", str(tmp_path / "nvidiactl"))
    assert not omp_wait.on_gpu("auto")
    assert omp_wait.spin_threads("auto", True).startswith("OpenMP's default")
    (tmp_path / "nvidiactl").touch()
    assert omp_wait.on_gpu("auto") and omp_wait.on_gpu("cuda:1") and not omp_wait.on_gpu("cpu")
    assert omp_wait.spin_threads("auto", True).startswith("OMP_WAIT_POLICY=ACTIVE")


@pytest.mark.parametrize("policy,env,want", [
    ("static,upper", {}, "OMP_WAIT_POLICY=ACTIVE (set by cmoe: CPU experts beside a GPU)"),
    ("lfu-fallback", {"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=PASSIVE as given"),
    ("upper", {}, None),
])
def test_the_cli_says_it_before_anything_else(policy, env, want):
    """A fresh `cmoe execute` process: the line comes before the input's own error (no --spec)."""
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    r = subprocess.run([str(CMOE), "execute", "--device", "cuda", "--policy", policy], capture_output=True,
                       text=True, env=e, timeout=120)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode != 0
    assert lines[-1] == "error: pass exactly one of --spec PRESET (random weights at its shapes) or --model DIR (a checkpoint)"
    assert lines[:-1] == ([want] if want else [])
