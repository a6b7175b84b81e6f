"""Issue 15: does the host-load sampler disturb the runs it watches? The same configurations run
with no sampler, with a sampler thread in this process (the validations' until the thirty-sixth
session: a read of /proc/stat and /proc/self/stat ten times a second, which takes the GIL; the
host program held the GIL through a pass then, and runs without it, `nogil`, since), and
with the sampler's child process (`cmoe.calibrate.host_load.LoadSampler` since), in rounds that
alternate the three, so a drift of the host falls on all alike. Per run: tokens/s, the LM head's
host step (`host_head`: median, and how many took over 120 us), layer 0's mean time (compute stream,
`cmoe.analysis.validate.layer_times`) and the other layers'.

    python benchmarks/sampler_ab_h200.py --out $OUT/sampler-ab.json [--pool 26 --batch 4 --rounds 3]
    python benchmarks/sampler_ab_h200.py --out /tmp/ab.json --embedded --device cpu --slots 4   # a CPU check

The OpenMP A/B (thirty-seventh session, `gpu_session.sh spin-ab`): processes alternating
`OMP_WAIT_POLICY=ACTIVE` (what validate_h200.py set for GPU-only policies until 49eb55a, and `cmoe
calibrate` sets unless its `--policy` names GPU-only policies alone: the thirty-sixth session's
validations used a median of 15.9 of the H100 host's 16 cores, the team spinning after
calibration's CPU experts) and `PASSIVE`, each `--wake-cpu` (a CPU matmul on the whole team before
every round, so the team exists and, under ACTIVE, spins through the runs); `cores` per run: the
process's CPU time over the run's wall time. `WAITS="default PASSIVE"` puts libgomp's default
(`OMP_WAIT_POLICY` unset) against `PASSIVE` (thirty-eighth session).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.omp_wait import spin_threads  # noqa: E402  (before torch: libgomp reads it on load)

SPIN = spin_threads("auto", False)    # GPU-only policies: as validate_h200.py and `cmoe run` run them

import numpy as np  # noqa: E402

from benchmarks.sampler_heads import holds  # noqa: E402
from cmoe.analysis.validate import layer_times  # noqa: E402
from cmoe.calibrate.host_load import LoadSampler, available, snapshot  # noqa: E402
from cmoe.core.timeline import END, LAYER, OP, START, STEP  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402

MODES = ("none", "thread", "process")


class _ThreadSampler:
    """The sampler as it was: a daemon thread of this process, one `snapshot()` every interval."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.samples, self._stop = interval, [], threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(snapshot())

    def start(self):
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _sampler(mode: str):
    if mode == "thread" and available():
        return _ThreadSampler(0.1).start()
    if mode == "process":
        return LoadSampler(0.1).start()
    return None


def _wake_cpu() -> None:
    """One parallel region on torch's whole CPU team (a 2048-square matmul)."""
    import torch
    a = torch.ones(2048, 2048)
    (a @ a).sum().item()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _row(r, mode: str, policy: str, rnd: int, sampled: list[float]) -> dict:
    """One run's figures; `sampled`: the epoch times the sampler took its samples at, to count the
    long heads (over 120 us) with a sample inside them (from 0.5 ms before: the thirty-fifth
    session's validation had one in 90% of its long heads and in none of its short ones)."""
    log = r.log
    dec = {p for p, d, _, _ in log.pass_us if d}
    spans = [s for s in log.spans if s[OP] == "host_head" and s[STEP] in dec]
    heads = [s[END] - s[START] for s in spans]
    ts = np.array(sorted(sampled))
    hit = sum(holds(ts, s[START] / 1e6 + log.clock_epoch, s[END] / 1e6 + log.clock_epoch)
              for s in spans if s[END] - s[START] > 120)
    lt = layer_times(log.spans, dec)
    first = min(layer for _, layer in lt) if lt else 0
    l0 = [v for (_, layer), v in lt.items() if layer == first]
    rest = [v for (_, layer), v in lt.items() if layer != first]
    return {"round": rnd, "mode": mode, "policy": policy, "tokens_per_s": r.metrics["tokens_per_s"],
            "head_median_us": statistics.median(heads) if heads else None, "heads_over_120us": sum(h > 120 for h in heads),
            "heads": len(heads), "long_heads_with_a_sample": hit, "layer0_mean_us": statistics.fmean(l0) if l0 else None,
            "other_layers_mean_us": statistics.fmean(rest) if rest else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--spec", default="mixtral-8x7b")
    ap.add_argument("--embedded", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--pool", type=float, default=26.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="lru-prefetch,ondemand")
    ap.add_argument("--modes", default=",".join(MODES), help="samplers to alternate (none, thread, process)")
    ap.add_argument("--wake-cpu", action="store_true", help="a CPU matmul on torch's whole team before each round")
    a = ap.parse_args()
    modes = tuple(a.modes.split(","))
    if set(modes) - set(MODES):
        sys.exit(f"sampler_ab_h200: --modes takes {', '.join(MODES)}; got {a.modes}")
    if a.embedded:
        from cmoe.data import default_model
        where = {"spec_name": None, "model_dir": default_model(), "trace_src": "embedded", "data": None}
    else:
        where = {"spec_name": a.spec, "model_dir": None, "trace_src": f"synthetic:{a.spec}", "data": None}
    policies = tuple(a.policies.split(","))
    cfg = ExecConfig(policies=policies, pool_gb=a.pool, batch=a.batch, tokens=a.tokens, device=a.device, slots=a.slots)
    t0 = time.perf_counter()
    w, cfg = prepare(cfg=cfg, **where)
    build(w, cfg)
    for p in ("upper", *policies):       # untimed: kernels, allocator, every KV length, and each policy's
        run_policy(w, cfg, p)             # compiled program and twins (a fresh machine's numba cache is
    print(f"built and warmed in {time.perf_counter() - t0:.0f} s", flush=True)   # empty: ~30 s each)
    rows = []
    for rnd in range(a.rounds):
        if a.wake_cpu:
            _wake_cpu()
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            s = _sampler(mode)
            try:
                for p in policies:
                    c0, t0 = _cpu_s(), time.perf_counter()
                    res = run_policy(w, cfg, p)
                    cores = (_cpu_s() - c0) / (time.perf_counter() - t0)
                    rows.append(_row(res, mode, p, rnd, [x[0] for x in s.samples] if s is not None else []))
                    x = rows[-1]
                    x["cores"] = round(cores, 2)
                    print(f"round {rnd} {os.environ.get('OMP_WAIT_POLICY', 'default'):<7} {mode:<8} {p:<13} "
                          f"{x['tokens_per_s']:8.2f} tok/s, {cores:5.2f} cores, head median "
                          f"{x['head_median_us'] or 0:6.1f} us, {x['heads_over_120us']:2d} of {x['heads']} over 120 us "
                          f"({x['long_heads_with_a_sample']} with a sample), "
                          f"layer 0 {x['layer0_mean_us'] or 0:7.1f} us, others {x['other_layers_mean_us'] or 0:7.1f} us",
                          flush=True)
            finally:
                if s is not None:
                    s.stop()
    write_text_atomic(a.out, json.dumps({"date": time.strftime("%Y-%m-%d"), "spec": a.spec, "pool": a.pool,
                                         "batch": a.batch, "tokens": a.tokens, "omp_wait": SPIN, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
