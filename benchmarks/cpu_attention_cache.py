"""Does a CPU's decode attention cost by its keys or by the cache it was given (issue 15)? The
executor allocates a static KV cache for the trace's longest request, and on a CPU the attention
is SDPA over that whole cache, masked. This runs the embedded model's `upper` at batch 1 over
synthetic traces that hold the keys fixed (prompt 16, 32 decode steps timed) while the cache grows
(the trace's decode length sets it), and one with the keys grown instead, in rounds that take turns
(ROUNDS, the arms in the same order each round), and prints each arm's median layer time outside the experts.

    python benchmarks/cpu_attention_cache.py --out /tmp/cache.json      # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ARMS = {"cache 52 (16+36)": (16, 36), "cache 216 (16+200)": (16, 200), "cache 1040 (16+1024)": (16, 1024),
        "cache 216, prompt 180 (180+36)": (180, 36)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    from cmoe.calibrate.spans import _per_layer
    from cmoe.data import default_model
    from cmoe.executor.run import ExecConfig, Workload, budget_recipe, build, prepare, run_policy
    from cmoe.trace.synthetic import SyntheticParams, generate
    cfg = ExecConfig(policies=("upper",), pool_gb=1e3, batch=1, tokens=32, device="cpu", quant=None, slots=4,
                     progress=False)
    w, cfg = prepare(spec_name=None, model_dir=default_model(), trace_src="embedded", data=None, cfg=cfg)
    build(w, cfg)

    def on(prompt: int, decode: int) -> Workload:
        t = generate(w.spec, budget_recipe(w.fmt), SyntheticParams(requests=1, prompt_len=prompt, decode_len=decode, seed=1))
        nw = Workload(spec=w.spec, device=w.device, fmt=w.fmt, trace=t, model_dir=w.model_dir)
        nw.store, nw.model, nw.shims = w.store, w.model, w.shims
        return nw
    works = {k: on(*v) for k, v in ARMS.items()}
    us: dict[str, list[float]] = {k: [] for k in ARMS}
    for _ in range(a.rounds):
        for k, x in works.items():
            run_policy(x, cfg, "upper")                        # untimed: the last run was another cache's
            ne, _ = _per_layer(run_policy(x, cfg, "upper").log, ("attention",), x.spec.moe_layers[0])
            us[k].append(ne / x.spec.num_layers)
    rows = {k: {"cache_slots": works[k].trace.cache_slots, "median_us": statistics.median(v), "runs_us": v}
            for k, v in us.items()}
    for k, r in rows.items():
        print(f"{k:32} cache {r['cache_slots']:5d}  median {r['median_us']:6.1f} us a layer")
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
