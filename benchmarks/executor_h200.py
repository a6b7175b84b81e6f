"""Measured on a GPU: the executor under every policy, Mixtral-8x7B shapes (W4A16 g128 experts,
random seeded weights), a synthetic trace, N decode tokens, batch 1 and 8, one pool size.

Also measures the two ceilings the figures are read against, on the same card: HBM bandwidth
(a 4 GiB device-to-device copy, bytes read + written) and pinned H2D bandwidth for one expert.
Writes results.json under --out after every run, so a run cut short still leaves its figures,
and the batch-1 timelines of `upper` and `commit` as Parquet.

    python benchmarks/executor_h200.py --out $OUT --tokens 256 --batches 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402
from cmoe.policy.policies import POLICIES  # noqa: E402
from cmoe.core.quant import non_expert_bytes  # noqa: E402
from cmoe.core.timeline import STEP, OP, BYTES, write_parquet  # noqa: E402


def hbm_gbps() -> float:
    n = 4 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_()
    b = torch.empty_like(a)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / best / 1e9


def h2d_gbps(nbytes: int) -> float:
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h.random_()
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        s.record()
        d.copy_(h, non_blocking=True)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    return nbytes / best / 1e9


def upper_floor_ms(r, spec, hbm: float) -> float:
    """Bytes one decode pass of `upper` must read (resident weights + the experts it ran, each
    once), over the measured HBM bandwidth: the time no implementation beats."""
    from cmoe.executor.run import budget_recipe
    ne = non_expert_bytes(spec, budget_recipe("w4g128"))
    # the embedding table: one row a token, ~0 (with tied embeddings it is the LM head, read whole)
    resident = sum(ne.values()) - (0 if spec.tie_embeddings else ne["embeddings"] // 2)
    dec = {p for p, d, _, _ in r.log.pass_us if d}
    expert = sum(s[BYTES] for s in r.log.spans if s[OP] == "expert" and s[STEP] in dec) / max(len(dec), 1)
    return (resident + expert) / (hbm * 1e9) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--pool-gb", type=float, default=20.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--spec", default="mixtral-8x7b")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps of the untimed warm-up run of each batch")
    ap.add_argument("--profile", default="", help="cProfile one short run of this policy first and print the top host functions")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    policies = tuple(a.policies.split(","))
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()   # as lean_h200.py
    res = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": commit, "spec": a.spec, "tokens": a.tokens, "pool_gb": a.pool_gb,
           "hbm_gbps": hbm_gbps(), "h2d_gbps_one_expert": h2d_gbps(93_585_408), "runs": []}
    print(f"HBM {res['hbm_gbps']:.0f} GB/s, H2D {res['h2d_gbps_one_expert']:.1f} GB/s", flush=True)
    store = model = shims = None
    for batch in [int(b) for b in a.batches.split(",")]:
        cfg = ExecConfig(policies=policies, pool_gb=a.pool_gb, batch=batch, tokens=a.tokens, device="cuda")
        w, cfg = prepare(spec_name=a.spec, model_dir=None, trace_src=f"synthetic:{a.spec}", data=None, cfg=cfg)
        if store is None:
            t0 = time.perf_counter()
            build(w, cfg)
            store, model, shims = w.store, w.model, w.shims
            res["build_s"] = time.perf_counter() - t0
            print(f"built store ({store.nbytes / 1e9:.1f} GB pinned) and model in {res['build_s']:.0f} s", flush=True)
        w.store, w.model, w.shims = store, model, shims
        from dataclasses import replace
        run_policy(w, replace(cfg, tokens=a.warmup), "upper")    # warm-up, untimed: kernels, allocator, caches
        if a.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            r = run_policy(w, replace(cfg, tokens=8), a.profile)
            pr.disable()
            print(r.metrics["tpot_ms_mean"], "ms/token under the profiler")
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        for p in policies:
            t0 = time.perf_counter()
            r = run_policy(w, cfg, p)
            m = dict(r.metrics, wall_s=time.perf_counter() - t0)
            if p == "upper":
                m["hbm_floor_ms"] = upper_floor_ms(r, w.spec, res["hbm_gbps"])
            res["runs"].append(m)
            print(f"batch {batch} {p:<13} {m['tokens_per_s']:8.1f} tok/s  TPOT {m['tpot_ms_mean']:7.2f} ms  "
                  f"loads {m['loads']:6d}  H2D {m['h2d_gbps']:5.1f} GB/s  outside experts {m['outside_experts_ms_per_pass']:.2f} ms  "
                  f"route {m['route_ms_per_pass']:.2f} ms  ({m['wall_s']:.0f} s)", flush=True)
            if batch == 1 and p in ("upper", "commit"):
                write_parquet(r.log.spans, a.out / f"timeline-b{batch}-{p}.parquet")
            (a.out / "results.json").write_text(json.dumps(res, indent=1))
            del r


if __name__ == "__main__":
    main()
