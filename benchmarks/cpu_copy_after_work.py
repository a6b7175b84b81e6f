"""What one expert-sized copy costs on a CPU, by what came before it (issue 15). On a CPU the
executor's "link" is the host copying a store's expert into a pool slot (`DevicePool.load`), and
calibrate's copy curve timed the same two buffers back to back, which made every CPU run's loads
look 3x slower than calibrated (`cmoe.calibrate.link_fit.copied_fit` says what changed). This
times one `copy_` of BYTES (the embedded model's 52,224-byte expert by default) after each of:

- `again`: the same copy just before (calibrate's old way);
- `moved`: nothing, but from a new place in a 64 MiB buffer each time (bytes the caches lack);
- `busy`: 2 ms of the host spinning in Python first (other host work, the same source);
- `busy-moved`: both;

at each torch thread count of THREADS, drawn in a seeded random order so that drift falls on all
alike. Medians and means in us, written to --out as JSON and printed.

    python benchmarks/cpu_copy_after_work.py --out /tmp/copy.json       # ~10 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

BIG = 64 << 20
KINDS = ("again", "moved", "busy", "busy-moved")


def one(kind: str, src: torch.Tensor, dst: torch.Tensor, i: int) -> float:
    n = dst.numel()
    off = (i * 1_000_003) % (BIG - n) if "moved" in kind else 0
    s = src[off:off + n]
    if kind == "again":
        dst.copy_(s)
    if "busy" in kind:
        end = time.perf_counter() + 2e-3
        while time.perf_counter() < end:
            pass
    t0 = time.perf_counter()
    dst.copy_(s)
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bytes", type=int, default=52_224)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=150)
    a = ap.parse_args()
    torch.manual_seed(0)
    src = torch.empty(BIG, dtype=torch.uint8).random_()
    dst = torch.empty(a.bytes, dtype=torch.uint8)
    order = [(int(t), k) for t in a.threads.split(",") for k in KINDS for _ in range(a.repeats)]
    random.Random(0).shuffle(order)
    times: dict[str, list[float]] = {}
    for i, (t, k) in enumerate(order):
        torch.set_num_threads(t)
        times.setdefault(f"{t} {k}", []).append(one(k, src, dst, i))
    rows = {key: {"median_us": float(np.median(v)), "mean_us": float(np.mean(v)), "n": len(v)}
            for key, v in sorted(times.items())}
    for key, r in rows.items():
        print(f"threads {key:14} median {r['median_us']:6.1f} us  mean {r['mean_us']:6.1f} us")
    rec = {"date": time.strftime("%Y-%m-%d"), "bytes": a.bytes, "torch": torch.__version__, "rows": rows}
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
