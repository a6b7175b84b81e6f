"""Why the host's pass boundary misses layer 0 (issue 15): the host lane's two speeds. Per loading
policy's pair of decode passes in a validation's measured runs, the boundary as calibrate reads it
(`cmoe.analysis.boundary.boundaries`: the LM head's host step plus the next pass's start) beside
that next pass's host speed (`boundary_rows`: its median `host_attention` past the first layer), the
pass's loads and its last read-back wait. Per folder (a loan, its own calibration): the median
boundary in the fast and the slow state, the share of pairs in the slow one by loads a pass, and
how much the boundary follows the wait, the loads and the speed within a run (and a state), where
the simulator's price can only follow the first two.

    python benchmarks/boundary_states.py FOLDER [FOLDER ...]   # validate_h200.py's, or the tarballs
    python benchmarks/boundary_states.py /work/.device/11+/work/.device/13   # a loan over two calls

A folder `A+B` is one loan: B's meas-bB.tgz tarballs are unpacked beside A's (the same profile).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.validate_table import unpacked  # noqa: E402
from cmoe.analysis.boundary import boundary_rows  # noqa: E402
from cmoe.analysis.validate import read_run  # noqa: E402
from cmoe.core.hw import load_profile  # noqa: E402
from cmoe.policy.policies import trait  # noqa: E402

TOOL = "boundary_states.py"
LOADING = ("ondemand", "lru-prefetch", "commit", "oracle")
LOAD_BINS = (0, 5, 9, 17, 33, float("inf"))


def loan_runs(spec: str, work: Path) -> tuple[Path, list[Path]]:
    """(the folder with the loan's profile and results.json, its `pool*-b*` folders): `spec` one
    folder (`unpacked`), or `A+B...` where each B holds a later call's meas-bB.tgz on the same loan
    (no head.tgz: a calibration of its own), unpacked under WORK/extraN (A is left as it came). One
    line and exit where a B is not that, or measured a configuration A has."""
    first, *more = (Path(p) for p in spec.split("+"))
    folder = unpacked(first, work, TOOL)
    runs = sorted(folder.glob("pool*-b*"))
    for i, extra in enumerate(more):
        tars = sorted(extra.glob("meas-b*.tgz"))
        if (extra / "head.tgz").is_file() or not tars:
            sys.exit(f"{TOOL}: {extra} must hold a later call's meas-bB.tgz on {first}'s loan and no head.tgz "
                     "(a calibration of its own): give such a folder on its own, not after +")
        out = work / f"extra{i}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for t in tars:
            with tarfile.open(t) as tar:
                tar.extractall(out, members=[m for m in tar.getmembers() if m.name.startswith("pool")], filter="data")
        got = sorted(out.glob("pool*-b*"))
        if clash := sorted({p.name for p in got} & {p.name for p in runs}):
            sys.exit(f"{TOOL}: {extra} measured {', '.join(clash)} again, which {first} has: one loan's calls "
                     "measure different batches")
        runs += got
    return folder, runs


def loan_pairs(spec: str, work: Path) -> tuple[str, np.ndarray]:
    """(the loan's commit, [run index, boundary us, host speed us, loads, last wait us, price us]
    per pair of its loading policies' runs)."""
    folder, runs = loan_runs(spec, work)
    prof = load_profile(str(folder / "profile.json"))
    commit = json.loads((folder / "results.json").read_text()).get("commit", "?")
    rows, k = [], 0
    for mdir in (r / "measured" for r in runs):
        for m in json.loads((mdir / "metrics.json").read_text()):
            if m["policy"] not in LOADING:
                continue
            run = read_run(mdir, m["policy"])
            cpu = trait(m["policy"], "cpu_experts")
            rows += [[k, head + start, v, n, w, prof.boundary_price_us(lat, w, cpu)]
                     for (w, head, start, n, lat), v in zip(*boundary_rows(run), strict=True)]
            k += 1
    return commit, np.array(rows, np.float64).reshape(-1, 6)


def within(a: np.ndarray, x: int, y: int, groups: np.ndarray) -> float:
    """Pearson r of columns x and y with each group's means taken off (nan with too few)."""
    dx, dy = a[:, x].copy(), a[:, y].copy()
    for g in np.unique(groups):
        m = groups == g
        dx[m] -= dx[m].mean()
        dy[m] -= dy[m].mean()
    ok = dx.std() > 0 and dy.std() > 0
    return float(np.corrcoef(dx, dy)[0, 1]) if ok else float("nan")


def report(name: str, commit: str, a: np.ndarray, slow_us: float) -> None:
    slow = a[:, 2] >= slow_us

    def med(col: int, m: np.ndarray, f: str) -> str:          # "-" for a state no pair was in
        return format(float(np.median(a[m, col])), f) if m.any() else "-"
    print(f"{name} ({commit}): {len(a)} pairs in {len(np.unique(a[:, 0]))} runs; slow state {slow.mean():.0%}; "
          f"median boundary fast {med(1, ~slow, '.0f')} / slow {med(1, slow, '.0f')} us "
          f"(price {np.median(a[:, 5]):.0f}); host layer fast {med(2, ~slow, '.1f')} / slow {med(2, slow, '.1f')} us")
    bins = [f"{lo:g}-{hi - 1:g} {slow[(a[:, 3] >= lo) & (a[:, 3] < hi)].mean():.0%}"
            for lo, hi in zip(LOAD_BINS, LOAD_BINS[1:]) if ((a[:, 3] >= lo) & (a[:, 3] < hi)).any()]
    print("  share slow by loads a pass: " + ", ".join(bins))
    state = a[:, 0] * 2 + slow
    print(f"  r with the boundary, within a run: speed {within(a, 1, 2, a[:, 0]):.2f}, wait "
          f"{within(a, 1, 4, a[:, 0]):.2f}, loads {within(a, 1, 3, a[:, 0]):.2f}, price {within(a, 1, 5, a[:, 0]):.2f}; "
          f"within a run and state: wait {within(a, 1, 4, state):.2f}, loads {within(a, 1, 3, state):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--slow-us", type=float, default=3.0,
                    help="a pass whose median host_attention past layer 0 takes this long or more is in the slow state")
    ap.add_argument("--work", type=Path, default=Path("/tmp/cmoe-boundary-states"))
    a = ap.parse_args()
    pooled = []
    for i, spec in enumerate(a.folders):
        commit, rows = loan_pairs(spec, a.work / str(i))
        if not len(rows):
            sys.exit(f"{TOOL}: {spec} has no loading policy's run with a pass boundary")
        report(spec, commit, rows, a.slow_us)
        rows[:, 0] += 10_000 * i
        pooled.append(rows)
    if len(pooled) > 1:
        report("all", "-", np.concatenate(pooled), a.slow_us)


if __name__ == "__main__":
    main()
