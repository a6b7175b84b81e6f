"""The host's pass boundary in a validation's measured runs (issue 15's layer-0 misses,
`cmoe.analysis.boundary`), read as calibrate reads it (`cmoe.calibrate.spans`): a decode pass's LM-head host step (`host_head`), then
the next pass's start, the host lane's gap from that head's end to the next pass's first
`host_attention` plus that pass's layer-0 excess over its other layers (`host_gaps`,
`first_excess`: what `host_pass_start_us` prices). Per configuration and policy, the medians of
both, the loads a pass made, and the model's price for the same boundary (`host_head_us`, plus
`host_pass_start_us` and its extras after a pass as long, `pass_start_extra_us`, and after its
last wait as long, `boundary_extra_us`); then, over the
loading policies, both by the read-back wait before the head (the pass's last `host_sync`); and
beside them what calibrate's own GPU-sleep runs saw (its `pass_start_samples`: waits of 0.1-3 ms,
no loads).

Where the runs' boundary is longer than the GPU's last layer and head, the GPU waits at layer 0,
where the validation's every-layer misses sit (forty-fifth session, BENCHMARKS.md).

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
from cmoe.analysis.boundary import boundaries, boundary_price  # noqa: E402
from cmoe.analysis.validate import read_run  # noqa: E402
from cmoe.policy.policies import trait  # noqa: E402
from cmoe.calibrate.wake import loading_boundary, pass_start_means  # noqa: E402
from cmoe.core.hw import load_profile  # noqa: E402

WAIT_BINS_US = (0, 100, 150, 200, 300, 500, 1000, 2000, 5000, float("inf"))
LOADING = ("ondemand", "lru-prefetch", "commit", "oracle")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cmoe-boundary"))
    a = ap.parse_args()
    folder = unpacked(a.folder, a.work, "boundary_by_wait.py")
    res = json.loads((folder / "results.json").read_text())
    prof = load_profile(str(folder / "profile.json"))
    print("pool batch policy: median head + next pass's start = boundary us (the model's price), loads a pass")
    pooled = []
    for c in res["configs"]:
        pool, b = c["pool_gb"], c["batch"]
        cells = []
        for pol in c["policies"]:
            rows = boundaries(read_run(folder / f"pool{pool:g}-b{b}" / "measured", pol))
            got = boundary_price(rows, prof, trait(pol, "cpu_experts"))
            if got is None:                     # no read-back (its host runs passes ahead), or no pairs
                cells.append(f"{pol} -")
            else:
                rows = np.array(rows)
                h, st = np.median(rows[:, 1]), np.median(rows[:, 2])
                cells.append(f"{pol} {h:.0f} + {st:.0f} = {got[0]:.0f} ({got[1]:.0f}), {np.median(rows[:, 3]):.0f}")
                if pol in LOADING:
                    pooled.append(rows)
        print(f"{pool:g} {b}: " + "; ".join(cells))
    a_ = np.concatenate(pooled) if pooled else np.zeros((0, 5))
    print("\nloading policies, by the pass's last read-back wait: median head / next start us (passes)")
    for lo, hi in zip(WAIT_BINS_US, WAIT_BINS_US[1:]):
        m = (a_[:, 0] >= lo) & (a_[:, 0] < hi)
        if m.sum():
            print(f"  wait {lo:g}-{hi:g} us: {np.median(a_[m, 1]):.0f} / {np.median(a_[m, 2]):.0f} ({m.sum()})")
    meas = folder / "profile.measurements.json"
    if meas.is_file():
        host = json.loads(meas.read_text())["layer"].get("host") or {}
        starts = host.get("pass_start_samples", [])
        print("\ncalibrate's GPU-sleep runs (no loads), by lead us: median previous pass ms, head us; pass start us")
        means = pass_start_means(starts)
        for lead, pairs in starts:
            if pairs:
                x = np.array(pairs)
                head = f"{np.median(x[:, 4]):.0f}" if x.shape[1] > 4 else "-"   # samples before the head was kept
                print(f"  {lead:g}: {np.median(x[:, 0]) / 1e3:.1f} ms, head {head}")
        print("  pass start, mean over the lead's runs: " + ", ".join(f"{k:g}: {v[1]:.0f}" for k, v in means.items()))
        if lb := loading_boundary(host.get("loading_pass_start_samples") or []):
            print(f"calibrate's loading run (ondemand, top_k slots, {lb.loads:.0f} loads a pass): after "
                  f"{lb.prev_us / 1e3:.1f} ms passes, head {lb.head_us:.0f} us, start {lb.start_us:.0f} us, "
                  f"last wait {lb.wait_us:.0f} us"
                  + ("" if np.isnan(lb.host_us) else f", the next pass's host {lb.host_us:.1f} us a layer"))
    print(f"profile: host_head_us {prof.host_head_us:.0f}, host_pass_start_us {prof.host_pass_start_us:.0f}, "
          f"host_pass_start_points {[[round(x), round(y)] for x, y in prof.host_pass_start_points]}, "
          f"host_boundary_points {[[round(x), round(y)] for x, y in prof.host_boundary_points]}")


if __name__ == "__main__":
    from cmoe.core.errors import CmoeError
    try:
        main()
    except CmoeError as e:                     # one line, no traceback (a batch's tarball missing, say)
        sys.exit(f"boundary_by_wait.py: {e}")
