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


def test_gpu_session_refuses_a_validation_bound_shorter_than_its_calibration():
    """`validate`'s guard, run alone: VT under 260 s with the built model calibrated is refused in one
    line before the device spends it (the fifty-first session's call lost 190 s so); with a profile
    given, the cut model calibrated, or VT unset, it passes."""
    script = (ROOT / "benchmarks/gpu_session.sh").read_text()
    start = script.index("  validate) ") + len("  validate) ")
    guard = script[start:script.index("rm -rf /tmp/v; timeout ${VT:-560}")]
    env = {k: v for k, v in os.environ.items() if k not in ("VT", "CAL", "PROFILE")}

    def run(**kw):
        return subprocess.run(["bash", "-c", guard + "echo on"], capture_output=True, text=True, env=env | kw)
    r = run(VT="170", CAL="built")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("gpu_session: VT=170 bounds the whole validation, and the built model's build and calibration "
                        "take 185-220 s before any run: give VT 260 or more, or PROFILE=FILE.json\n")
    assert run(VT="170").returncode == 2                      # CAL defaults to both: the built model too
    for ok in ({"VT": "170", "CAL": "cut"}, {"VT": "170", "PROFILE": "p.json"}, {"VT": "260"}, {}):
        r = run(**ok)
        assert (r.returncode, r.stdout, r.stderr) == (0, "on\n", "")
