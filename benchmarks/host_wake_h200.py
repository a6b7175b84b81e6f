"""The host's step after a wait (issue 15): how long a fixed piece of host work takes right after
the host thread waited W ms, by what it waited on. The lean executor's host route step runs right
after a read-back wait, and the validations found it 1.3-4x slower in loading runs than in
calibration; the tenth session saw it slow after waits over ~2 ms, with the event polled as well
as synchronised. This separates the suspects in one run, each (kind, W) drawn in a seeded random
order so drift falls on all alike:

- `sync` / `poll`: the GPU spins W ms (`torch.cuda._sleep`), the host waits in
  `cudaEventSynchronize` / polls `cudaEventQuery`;
- `copy-sync` / `copy-poll`: an H2D copy of W ms worth of pinned bytes instead (what a loading
  policy's wait overlaps), the same two waits;
- `sleep`: the host sleeps W ms, no GPU work (a vCPU that halts);
- `busy`: the host spins W ms in Python, no GPU work (the control: nothing idles).

The work (`step`): the route step's kinds of host work, timed each: numpy on a read-back's routes
(`parse`), pure Python planning over dicts and lists (`plan`), three small pinned H2D copies
issued (`issue`), and a CUDA graph of 12 small kernels launched (`replay`); then the same step
again at once (`again`), to tell a first-step-after-the-wait cost from a slow host.

    python3 benchmarks/host_wake_h200.py --out $OUT/host-wake.json        # ~30 s on the H200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.util import write_text_atomic  # noqa: E402

KINDS = ("sync", "poll", "copy-sync", "copy-poll", "sleep", "busy")
WAITS_MS = (0.05, 0.2, 0.5, 1.0, 2.0, 4.0)
NS = time.perf_counter_ns


class Work:
    """One host route step's kinds of work, each timed in ns."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.routes = torch.empty(8, 4, dtype=torch.int32).pin_memory()
        self.ids = [torch.zeros(64, dtype=torch.int32).pin_memory() for _ in range(3)]
        self.dev = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(3)]
        self.x = torch.randn(1, 4096, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = self.x
            for _ in range(3):                          # warm the kernels before capture
                y = (self.x * 1.0001 + 0.5).relu_()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            y = self.x
            for _ in range(12):
                y = y * 1.0001 + 0.0001
            self.y = y
        torch.cuda.synchronize()

    def step(self) -> dict:
        t = [NS()]
        r = self.routes.numpy()
        r[:] = self.rng.integers(0, 8, r.shape)          # what a read-back brings
        order = np.argsort(r[:, :2].ravel(), kind="stable")
        needed = np.unique(r[:, :2]).tolist()
        t.append(NS())
        resident = {e: (e * 7) % 20 for e in range(0, 8, 2)}
        loads, slots = [], {}
        for e in needed:
            if e in resident:
                slots[e] = resident[e]
            else:
                loads.append((e, len(slots) + len(loads)))
        plan = sorted(slots.items()) + sorted(loads)
        rows = {e: [int(i) for i in order if r.ravel()[i] == e] for e in needed}
        t.append(NS())
        for h, d in zip(self.ids, self.dev):
            h[: len(plan)] = torch.tensor([p[1] for p in plan], dtype=torch.int32)
            d.copy_(h, non_blocking=True)
        t.append(NS())
        self.graph.replay()
        t.append(NS())
        assert len(rows) == len(needed)
        return {k: (t[i + 1] - t[i]) / 1e3 for i, k in enumerate(("parse", "plan", "issue", "replay"))}


def spin_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles in one ms on this GPU, from a timed 2-ms-ish spin."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(4_000_000)
    b.record()
    b.synchronize()
    return 4_000_000 / a.elapsed_time(b)


def wait(kind: str, ms: float, cyc: float, src: torch.Tensor, dst: torch.Tensor, rate: float) -> None:
    if kind in ("sleep", "busy"):
        if kind == "sleep":
            time.sleep(ms / 1e3)
        else:
            end = NS() + int(ms * 1e6)
            while NS() < end:
                pass
        return
    ev = torch.cuda.Event()
    if kind.startswith("copy"):
        n = min(int(ms / 1e3 * rate), src.numel())
        dst[:n].copy_(src[:n], non_blocking=True)
    else:
        torch.cuda._sleep(int(ms * cyc))
    ev.record()
    if kind.endswith("sync"):
        ev.synchronize()
    else:
        while not ev.query():
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cyc = spin_cycles_per_ms()
    src = torch.empty(int(4.5e-3 * 60e9), dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    dst.copy_(src, non_blocking=True)
    e1.record()
    e1.synchronize()
    rate = src.numel() / (e0.elapsed_time(e1) / 1e3)   # bytes a second, H2D
    work = Work(a.seed)
    for _ in range(50):
        work.step()
    torch.cuda.synchronize()
    rng = random.Random(a.seed)
    combos = [(k, w) for k in KINDS for w in WAITS_MS] + [("none", 0.0)]
    got = {c: [] for c in combos}
    for _ in range(a.reps):
        rng.shuffle(combos)
        for kind, ms in combos:
            torch.cuda.synchronize()
            wait(kind, ms, cyc, src, dst, rate)
            first = work.step()
            again = work.step()
            got[(kind, ms)].append((first, again))
    torch.cuda.synchronize()
    rows = []
    for (kind, ms), v in sorted(got.items(), key=lambda kv: (KINDS.index(kv[0][0]) if kv[0][0] in KINDS else -1, kv[0][1])):
        row = {"kind": kind, "wait_ms": ms}
        for part in ("parse", "plan", "issue", "replay"):
            row[part + "_us"] = float(np.median([f[part] for f, _ in v]))
        row["step_us"] = float(np.median([sum(f.values()) for f, _ in v]))
        row["step_p90_us"] = float(np.percentile([sum(f.values()) for f, _ in v], 90))
        row["again_us"] = float(np.median([sum(g.values()) for _, g in v]))
        rows.append(row)
        print(f"{kind:>9} {ms:4.2f} ms: step {row['step_us']:6.1f} us (p90 {row['step_p90_us']:6.1f}; "
              f"parse {row['parse_us']:5.1f} plan {row['plan_us']:5.1f} issue {row['issue_us']:5.1f} "
              f"replay {row['replay_us']:5.1f}), again {row['again_us']:6.1f}")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": a.reps, "seed": a.seed,
           "spin_cycles_per_ms": cyc, "h2d_gb_s": rate / 1e9, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
