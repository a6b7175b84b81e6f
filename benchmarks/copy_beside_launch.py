"""What a load on the link does to the fused expert launches of a validation's runs, measured and
predicted: for each policy, batch and count of experts in a launch, the median launch that started
while a load was on the link and the median of the others (`cmoe.calibrate.commit_steps.
launches_by_size`, the grouping calibrate's `copy_slowdowns` reads), the extra in microseconds and
as a ratio, pooled over the validation's pools (within one batch, launches of one count hold about
the same rows an expert), measured runs beside the simulator's.

    python benchmarks/copy_beside_launch.py F [--work W] [--policies oracle,lru-prefetch,commit] [--out J]

F: a folder `benchmarks/validate_h200.py` wrote (its `meas-b*.tgz` untarred: `poolP-bB/measured/`);
W: `benchmarks/validate_table.py`'s `--work` folder for it (`poolP-bB/predicted/`), for the
predicted side. Why: the profile prices a load beside the experts as one factor on their time
(`copy_compute_slowdown`, read off calibrate's `commit` run); the thirty-ninth session's H200 runs
showed the extra to be about the same microseconds for a `commit` launch as for a read-back
policy's of the same expert count (6-7 us at two experts, about 1 more for each further one), though
commit's launch is ~48 us longer, so the one factor, read off commit's, priced the read-back
launches' extra at 3.7 us where they took 6.5 (BENCHMARKS.md, thirty-ninth session).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.analysis.runfolder import read_timeline  # noqa: E402
from cmoe.calibrate.commit_steps import launch_points, launches_by_size  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402


def pooled(folders: list[Path], policy: str) -> dict[int, dict[bool, list]]:
    """Every run's fused launches of `policy` by expert count, pooled (each run's own first decode
    pass and layer 0 left out, as calibrate does); runs without the policy's timeline are skipped."""
    out: dict[int, dict[bool, list]] = {}
    for f in folders:
        if not (f / f"timeline-{policy}.parquet").exists():
            continue
        spans = read_timeline(f, policy)
        steps = sorted({s[1] for s in spans})
        log = SimpleNamespace(spans=spans, pass_us=[(p, p >= 1, 0, 0.0) for p in steps])
        for n, g in launches_by_size(log, 0).items():
            for busy, v in g.items():
                out.setdefault(n, {True: [], False: []})[busy] += v
    return out


def rows(groups: dict[int, dict[bool, list]]) -> dict[int, dict]:
    """Per expert count with `SLOW_MIN` launches on each side (`launch_points`, as calibrate reads
    them, here in us): the medians, their difference and ratio, and the counts."""
    return {n: {"quiet_us": q, "busy_us": b, "extra_us": b - q, "ratio": b / q, "quiet": nq, "busy": nb}
            for _, n, q, b, nq, nb in launch_points(groups, 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--policies", default="oracle,lru-prefetch,ondemand,commit")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    meas = sorted(a.folder.glob("pool*-b*/measured"))
    if not meas:
        sys.exit(f"{a.folder} holds no poolP-bB/measured folders: untar the validation's meas-b*.tgz into it first")
    sides = {"measured": meas}
    if a.work is not None:
        sides["predicted"] = sorted(a.work.glob("pool*-b*/predicted"))
    result: dict = {}
    batches = sorted({int(f.parent.name.split("-b")[1]) for f in meas})
    print("| policy | batch | experts in the launch | side | quiet us (launches) | beside a load us (launches) "
          "| extra us | ratio |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for pol in a.policies.split(","):
        for b in batches:
            for side, folders in sides.items():
                got = rows(pooled([f for f in folders if f.parent.name.endswith(f"-b{b}")], pol))
                result.setdefault(pol, {}).setdefault(str(b), {})[side] = got
                for n, r in got.items():
                    print(f"| {pol} | {b} | {n} | {side} | {r['quiet_us']:.1f} ({r['quiet']}) | {r['busy_us']:.1f} "
                          f"({r['busy']}) | {r['extra_us']:+.1f} | {r['ratio']:.3f} |")
    if a.out is not None:
        write_text_atomic(a.out, json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
