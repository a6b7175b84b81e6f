"""Simulator speed: simulated decode tokens per second of wall time, one process (one core).

Scenario: a synthetic trace (4 requests x 256 decode tokens after a 64-token prefill), batch 1,
each policy, for Mixtral-8x7B (32 layers, 8 experts, top-2) at a 20 GB pool and for
DeepSeek-V2-Lite (26 MoE layers, 64 experts, top-6) at a 6 GB pool. Wall time covers cutting
the trace into passes and the SimPy run. Target (issue 3): >= 1,000 simulated Mixtral tokens/s.
The SimPy model, named: `simulate` runs the compiled replay by default (benchmarks/replay_speed.py).

    .venv/bin/python benchmarks/sim_speed.py
"""

import time

from cmoe.core.hw import H200
from cmoe.core.quant import recipe
from cmoe.sim.run import SimConfig, simulate
from cmoe.core.spec import preset
from cmoe.trace.synthetic import SyntheticParams, generate

CASES = (("mixtral-8x7b", 20.0), ("deepseek-v2-lite", 6.0))
POLICIES = ("upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit")
REPEATS = 3

print("| model | policy | decode tokens | wall s (median of 3) | simulated tokens/s |")
print("| --- | --- | ---: | ---: | ---: |")
for model, pool in CASES:
    t = generate(preset(model), recipe("w4a16"), SyntheticParams())
    for pol in POLICIES:
        walls = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            r = simulate(t, H200, SimConfig(policy=pol, pool_gb=pool, engine="simpy"))
            walls.append(time.perf_counter() - t0)
        w = sorted(walls)[REPEATS // 2]
        n = r.metrics["decode_tokens"]
        print(f"| {model} | {pol} | {n} | {w:.3f} | {n / w:,.0f} |")
