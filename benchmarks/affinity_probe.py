"""Does pinning the host thread to one core steady the lean engine's host? (issues 13 and 15)

The host's own time per MoE layer differed up to 2x between runs of identical work on the H200
(BENCHMARKS.md, sixth session), and calibrated host fields do not reproduce across machines. This
runs the same policies alternately with the host thread free to use every core and pinned to one
(`CMOE_PIN_HOST=core:N`, which `cmoe.executor.run` holds around each run's passes: the thread that
issues the work, `cmoe.executor.affinity`), several times each, in
one process over one built store, the arms' order swapped every round (the host drifts over
minutes, so a fixed order would favour the arm that runs first), and reports each run's host
time per MoE layer, its tokens/s, and the spread of each arm; and, per run, the host lane's state
(forty-eighth session: on four H100 loans it ran for tens of passes at ~2.4 us a `host_attention`,
then at ~5, the pass boundary 173-242 us against 553-601; `benchmarks/boundary_states.py`): the
share of its pass boundaries whose next pass was slow (`--slow-us`) and the median boundary. If
the slow state is the thread moving to a busier or slower core, the pinned arm has none of it.

    python benchmarks/affinity_probe.py --out $OUT/affinity.json --policies ondemand,oracle --rounds 3
    python benchmarks/affinity_probe.py --out $OUT/affinity.json --policies lru-prefetch,ondemand --pool 26 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lean_h200 import decode_stats  # noqa: E402

from cmoe.analysis.boundary import host_state  # noqa: E402
from cmoe.executor.affinity import ENV  # noqa: E402
from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--policies", default="ondemand,oracle")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--pool", type=float, default=20.0)
    ap.add_argument("--core", type=int, default=-1, help="the core to pin to (-1: the second of those allowed)")
    ap.add_argument("--slow-us", type=float, default=3.0, help="a pass whose host_attention takes this long is slow")
    a = ap.parse_args()
    free = sorted(os.sched_getaffinity(0))
    core = a.core if a.core >= 0 else free[min(1, len(free) - 1)]
    pols = [p for p in a.policies.split(",") if p]
    cfg = ExecConfig(policies=("upper", *pols), pool_gb=a.pool, batch=1, tokens=a.tokens, device="cuda")
    w, cfg = prepare(spec_name="mixtral-8x7b", model_dir=None, trace_src="synthetic:mixtral-8x7b", data=None, cfg=cfg)
    build(w, cfg)
    run_policy(w, replace(cfg, tokens=4), "upper")                 # warm-up
    runs = []
    for r in range(a.rounds):
        for arm in ("free", "pinned") if r % 2 == 0 else ("pinned", "free"):
            os.environ[ENV] = f"core:{core}" if arm == "pinned" else "off"     # run_policy pins its passes
            for p in pols:
                res = run_policy(w, cfg, p)
                st = decode_stats(res, w.spec, float("nan"), 0.0)      # only its host figures are read
                slow, bound = host_state(res.log, a.slow_us)
                runs.append({"round": r, "arm": arm, "policy": p, "tok_s": res.metrics["tokens_per_s"],
                             "host_core": res.metrics["host_core"], "host_us_per_layer": st["host_work_us_per_layer"], "slow_share": slow, "boundary_us": bound})
                print(f"round {r} {arm:<6} {p:<12} {res.metrics['tokens_per_s']:7.2f} tok/s "
                      f"host {st['host_work_us_per_layer']:6.1f} us/layer, slow {slow:.0%}, boundary {bound:.0f} us", flush=True)
                del res
    os.environ.pop(ENV)
    summary = {}
    for p in pols:
        for arm in ("free", "pinned"):
            mine = [x for x in runs if x["policy"] == p and x["arm"] == arm]
            h, t, sl = ([x[k] for x in mine] for k in ("host_us_per_layer", "tok_s", "slow_share"))
            summary[f"{p} {arm}"] = {"host_us_min": min(h), "host_us_max": max(h), "host_us_mean": float(np.mean(h)),
                                     "slow_share_min": min(sl), "slow_share_max": max(sl),
                                     "tok_s_min": min(t), "tok_s_max": max(t),
                                     "tok_s_spread_pct": (max(t) - min(t)) / float(np.mean(t)) * 100}
            print(f"{p:<12} {arm:<6} host {min(h):6.1f}-{max(h):6.1f} us/layer, tok/s {min(t):.2f}-{max(t):.2f} "
                  f"({summary[f'{p} {arm}']['tok_s_spread_pct']:.1f}%), slow {min(sl):.0%}-{max(sl):.0%}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "cores": free, "pinned_to": core,
           "tokens": a.tokens, "pool_gb": a.pool, "slow_us": a.slow_us, "runs": runs, "summary": summary}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
