"""The tree a GPU benchmark's results name: `COMMIT` as `benchmarks/gpu_session.sh` is called, since
the device's copy of the tree may carry an older `.git` (thirty-ninth session: the kernel benchmark
recorded the session's first commit for a later tree); git's HEAD only without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernel_benchmark_names_commit_before_gits_head(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import expert_kernel_h200 as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("COMMIT", "abc1234")
    assert bench._commit() == "abc1234"
    monkeypatch.delenv("COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert bench._commit() == head


def test_gpu_session_says_when_commit_is_unset():
    """The script's warning, run alone (the script itself installs wheels and wants a GPU): said on
    stderr without COMMIT, nothing with it."""
    env = {k: v for k, v in os.environ.items() if k != "COMMIT"}
    script = (ROOT / "benchmarks/gpu_session.sh").read_text()
    start = script.index("# the device's copy of the tree may carry an older .git")
    line = script[start:].splitlines()[1]
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env)
    assert r.stderr.strip() == ("gpu_session: COMMIT is not set; results will carry the device's git HEAD, "
                                "which may lag the tree")
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env | {"COMMIT": "abc1234"})
    assert r.stderr == ""
