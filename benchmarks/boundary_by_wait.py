"""The host's pass boundary in a validation's measured runs (issue 15's layer-0 misses): per
configuration and policy, the medians of the LM-head host step (`host_head`) and the next pass's
start (its layer 0's `host_attention`), with the loads a pass made; then, over the loading
policies, both by the read-back wait before the head (the last layer's `host_sync`); and beside
them what calibrate's own GPU-sleep runs saw (`pass_start_samples` in profile.measurements.json:
waits as long, no loads).

The simulator prices the boundary as `host_head_us` plus `host_pass_start_us` (with its extra by the
previous pass's length, `host_pass_start_points`); where the runs' boundary is longer than the GPU's
last layer and head, the GPU waits at layer 0, which is where the validation's every-layer misses
sit (forty-fifth session, BENCHMARKS.md).

    python benchmarks/boundary_by_wait.py FOLDER    # validate_h200.py's, or the tarballs it came back as
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.validate_table import unpacked  # noqa: E402
from cmoe.analysis.validate import read_run  # noqa: E402
from cmoe.core.timeline import END, LAYER, OP, START, STEP  # noqa: E402

WAIT_BINS_US = (0, 100, 150, 200, 300, 500, 1000, 2000, 5000, float("inf"))
LOADING = ("ondemand", "lru-prefetch", "commit", "oracle")


def boundaries(run) -> list[tuple[float, float, float, int]]:
    """Per decode pass p followed by p + 1: (p's last-layer read-back wait, p's host head step,
    p + 1's layer-0 host step, p's loads), us; the first decode pass is left out (its start is the
    prefill's)."""
    dec = sorted(p["pass"] for p in run.passes if p["decode"])
    by: dict[int, list] = {}
    for s in run.spans:
        by.setdefault(s[STEP], []).append(s)
    last = max(s[LAYER] for s in run.spans)
    out = []
    for p in dec[1:]:
        if p + 1 not in by:
            continue
        head = [s[END] - s[START] for s in by[p] if s[OP] == "host_head"]
        start = [s[END] - s[START] for s in by[p + 1] if s[OP] == "host_attention" and s[LAYER] == 0]
        sync = [s[END] - s[START] for s in by[p] if s[OP] == "host_sync" and s[LAYER] == last]
        if head and start:
            out.append((sync[-1] if sync else 0.0, head[0], start[0], sum(1 for s in by[p] if s[OP] == "load")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cmoe-boundary"))
    a = ap.parse_args()
    folder = unpacked(a.folder, a.work)
    res = json.loads((folder / "results.json").read_text())
    print("pool batch policy: median head / next start us, loads a pass")
    pooled = []
    for c in res["configs"]:
        pool, b = c["pool_gb"], c["batch"]
        cells = []
        for pol in c["policies"]:
            rows = np.array(boundaries(read_run(folder / f"pool{pool:g}-b{b}" / "measured", pol)))
            if rows.size:
                cells.append(f"{pol} {np.median(rows[:, 1]):.0f}/{np.median(rows[:, 2]):.0f} ({np.median(rows[:, 3]):.0f})")
                if pol in LOADING:
                    pooled.append(rows)
        print(f"{pool:g} {b}: " + "; ".join(cells))
    a_ = np.concatenate(pooled) if pooled else np.zeros((0, 4))
    print("\nloading policies, by the last layer's read-back wait: median head / next start us (passes)")
    for lo, hi in zip(WAIT_BINS_US, WAIT_BINS_US[1:]):
        m = (a_[:, 0] >= lo) & (a_[:, 0] < hi)
        if m.sum() >= 8:
            print(f"  wait {lo:g}-{hi:g} us: {np.median(a_[m, 1]):.0f} / {np.median(a_[m, 2]):.0f} ({m.sum()})")
    meas = folder / "profile.measurements.json"
    if meas.is_file():
        host = json.loads(meas.read_text())["layer"].get("host") or {}
        print("\ncalibrate's GPU-sleep runs (no loads): lead us: median previous pass, head us")
        for lead, pairs in host.get("pass_start_samples", []):
            if pairs:
                x = np.array(pairs)
                print(f"  {lead:g}: {np.median(x[:, 0]) / 1e3:.1f} ms, {np.median(x[:, 4]):.0f}")
    prof = folder / "profile.json"
    if prof.is_file():
        p = json.loads(prof.read_text())
        print(f"profile: host_head_us {p.get('host_head_us', 0):.0f}, host_pass_start_us {p.get('host_pass_start_us', 0):.0f}, "
              f"host_pass_start_points {[[round(x), round(y)] for x, y in p.get('host_pass_start_points') or []]}")


if __name__ == "__main__":
    main()
