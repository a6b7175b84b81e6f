"""`benchmarks/copy_beside_launch.py`: a validation's fused expert launches beside a load and not, by
policy, batch and expert count, from the runs' timelines (measured and predicted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cmoe.core.timeline import Span, write_parquet

ROOT = Path(__file__).resolve().parents[1]


def _run(folder: Path, quiet_us: float, busy_us: float) -> None:
    """Passes 1-6 each: a two-expert launch at layer 1 beside a load (`busy_us`) and one at layer 2
    after it (`quiet_us`); pass 0 (prefill) and layer 0 carry launches the script must leave out."""
    spans = []
    for p in range(7):
        t = 1000.0 * p
        spans += [Span("gpu", p, 1, "copy0", "load", 7, t, t + 300.0, 1000),
                  Span("gpu", p, 0, "compute", "expert", 1, t + 10.0, t + 500.0, 0),
                  Span("gpu", p, 1, "compute", "expert", 2, t + 100.0, t + 100.0 + busy_us / 2, 0),
                  Span("gpu", p, 1, "compute", "expert", 3, t + 100.0 + busy_us / 2, t + 100.0 + busy_us, 0),
                  Span("gpu", p, 2, "compute", "expert", 2, t + 400.0, t + 400.0 + quiet_us / 2, 0),
                  Span("gpu", p, 2, "compute", "expert", 3, t + 400.0 + quiet_us / 2, t + 400.0 + quiet_us, 0)]
    folder.mkdir(parents=True)
    write_parquet(spans, folder / "timeline-oracle.parquet")


def test_the_launches_extra_beside_a_load_measured_and_predicted(tmp_path):
    for pool, quiet, busy in ((16, 70.0, 76.0), (26, 70.0, 77.0)):
        _run(tmp_path / "v" / f"pool{pool}-b1" / "measured", quiet, busy)
        _run(tmp_path / "w" / f"pool{pool}-b1" / "predicted", quiet, quiet * 1.05)
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/copy_beside_launch.py"), str(tmp_path / "v"), "--work",
                        str(tmp_path / "w"), "--policies", "oracle,commit", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["commit"] == {"1": {"measured": {}, "predicted": {}}}             # no commit timelines
    m, p = got["oracle"]["1"]["measured"]["2"], got["oracle"]["1"]["predicted"]["2"]
    assert (m["quiet_us"], m["busy_us"], m["quiet"], m["busy"]) == (70.0, 76.5, 12, 12)   # two pools pooled
    assert m["extra_us"] == 6.5 and p["extra_us"] == pytest.approx(3.5) and p["ratio"] == pytest.approx(1.05)
    assert "| oracle | 1 | 2 | measured | 70.0 (12) | 76.5 (12) | +6.5 | 1.093 |" in r.stdout.splitlines()


def test_a_folder_without_runs_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/copy_beside_launch.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == (f"{tmp_path} holds no poolP-bB/measured folders: untar the "
                                                      "validation's meas-b*.tgz into it first")
