"""A 10,000-point sweep on a local Ray cluster, interrupted and resumed.

Scenario: synthetic Mixtral-8x7B W4A16 (4 requests x 64 prefill + 256 decode tokens), `h200`
profile; a points file of 7 policies x 40 pool sizes (12-31.5 GB) x 4 batch sizes (1, 2, 4, 8) x
9 decode-step caps (32-288), the first 10,000. `cmoe sweep --points FILE --ray auto --jobs 2`
starts a local Ray cluster of 2 CPUs; after INTERRUPT_S seconds it gets SIGINT (Ctrl-C), then
the same command with `--resume` runs the rest. Checked: every point has one row, no point ran
twice (the rows written before the interrupt are unchanged, and the resumed run ran exactly the
missing ones).

    .venv/bin/python benchmarks/sweep_ray.py          # about 5 minutes on 2 cores
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POINTS = 10_000
INTERRUPT_S = 90
CMOE = str(Path(sys.executable).with_name("cmoe"))


def points_file(path: Path) -> None:
    pols = ["upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "oracle"]
    pools = [12 + 0.5 * i for i in range(40)]
    rows = itertools.islice(itertools.product(pols, pools, (1, 2, 4, 8), range(32, 289, 32)), POINTS)
    path.write_text("policy,pool_gb,batch,decode_steps\n" + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in rows))


def run(args: list[str], interrupt_after: float | None = None) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    p = subprocess.Popen([CMOE, "sweep", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=interrupt_after)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGINT)               # Ctrl-C: the whole process group, as a terminal does
        out, err = p.communicate()
    return time.perf_counter() - t0, out + err, p.returncode


def main() -> None:
    import polars as pl
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        points_file(d / "points.csv")
        table = d / "sweep.parquet"
        args = ["--points", str(d / "points.csv"), "--ray", "auto", "--jobs", "2", "--out", str(table)]
        s1, out1, rc1 = run(args, INTERRUPT_S)
        first = pl.read_parquet(table)
        print(f"interrupted after {s1:.0f} s (exit {rc1}): {first.height:,} points in the table, "
              f"{first.height / s1:.0f} points/s with Ray's start-up")
        print("   " + (out1.strip().splitlines() or [""])[-1])
        s2, out2, rc2 = run([*args, "--resume"])
        line = next((x for x in out2.splitlines() if x.startswith("wrote")), out2.strip()[-300:])
        print(f"resumed: {s2:.0f} s (exit {rc2}): {line}")
        df = pl.read_parquet(table)
        ran = int(re.search(r": (\d+) points run", line).group(1))
        kept = df.filter(pl.col("point_id").is_in(first["point_id"].to_list()))
        print(f"rows {df.height:,}, distinct points {df['point_id'].n_unique():,}, errors {int((df['error'] != '').sum())}, "
              f"ran on resume {ran:,} = {POINTS:,} - {first.height:,}: {ran == POINTS - first.height}, "
              f"rows from before the interrupt unchanged: {kept.sort('point_id').equals(first.sort('point_id'))}")
        print(f"total {s1 + s2:.0f} s for {POINTS:,} points: {POINTS / (s1 + s2):.0f} points/s on 2 CPUs")


if __name__ == "__main__":
    main()
