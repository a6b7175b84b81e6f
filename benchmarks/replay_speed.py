"""The compiled replay against the SimPy model, in one run on one machine: CPU seconds of a whole
`cmoe.sim.run.simulate` call (passes built, policy decisions, the clock, the metrics), simulated
decode tokens per CPU-second, the metrics compared for equality, and peak memory at 1x and 16x
trace length.

Scenario: the default synthetic traces (4 requests x 64 prefill + 256 decode tokens, batch 1,
`h200` profile), every policy, Mixtral-8x7B at a 20 GB pool and DeepSeek-V2-Lite at 6 GB; no
timeline (what `cmoe simulate` without --out and `cmoe sweep` ask for). Each call builds its own
passes and trace constants (the run's cache is cleared), so the figure is a whole call; CPU time (process_time) is
the median of REPEATS. The replay is compiled (and cached on disk) before timing; its one-time
costs are printed apart. Memory: how far one `ondemand` call (its passes included, the trace
itself not) raises a fresh process's peak RSS over what it held before, at 1x and 16x the decode
tokens (4 x 256 and 4 x 4,096), with and without a timeline.

    .venv/bin/python benchmarks/replay_speed.py            # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/replay_speed.py --quick    # speed only, one repeat
    .venv/bin/python benchmarks/replay_speed.py --memory   # memory only
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

CASES = (("mixtral-8x7b", 20.0), ("deepseek-v2-lite", 6.0))
REPEATS = 3
DECODE = 256


def trace(model: str, decode: int = DECODE):
    from cmoe.core.quant import recipe
    from cmoe.core.spec import preset
    from cmoe.trace.synthetic import SyntheticParams, generate
    return generate(preset(model), recipe("w4a16"), SyntheticParams(decode_len=decode))


def one_call(t, pool: float, policy: str, engine: str, timeline: bool = False) -> tuple[float, dict]:
    from cmoe.core.hw import H200
    from cmoe.sim import run
    run.clear_cache()
    t0 = time.process_time()
    r = run.simulate(t, H200, run.SimConfig(policy=policy, pool_gb=pool, engine=engine), timeline=timeline)
    return time.process_time() - t0, r.metrics


def speed(repeats: int) -> list[dict]:
    from cmoe.policy.policies import POLICIES
    rows = []
    for model, pool in CASES:
        t = trace(model)
        for pol in POLICIES:
            sim = [one_call(t, pool, pol, "simpy") for _ in range(repeats)]
            rep = [one_call(t, pool, pol, "replay") for _ in range(repeats)]
            s, r = statistics.median(x for x, _ in sim), statistics.median(x for x, _ in rep)
            n = sim[0][1]["decode_tokens"]
            rows.append({"model": model, "policy": pol, "tokens": n, "simpy_s": s, "replay_s": r,
                         "identical": sim[0][1] == rep[0][1], "tok_per_cpu_s": (n / s, n / r)})
    return rows


def memory_child(model: str, pool: float, decode: int, engine: str, timeline: bool) -> None:
    """In a fresh process: how far one simulate call (its passes included) raises RSS over what
    the process held before it, in MB, printed as JSON. A short call first imports and loads
    everything; the kernel's peak counter is then reset (/proc/self/clear_refs)."""
    import gc
    from cmoe.core.hw import H200
    from cmoe.sim import run
    cfg = run.SimConfig(policy="ondemand", pool_gb=pool, engine=engine)
    run.simulate(trace(model, 4), H200, cfg, timeline=timeline)
    t = trace(model, decode)
    run.clear_cache()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_mb("VmRSS")
    r = run.simulate(t, H200, cfg, timeline=timeline)
    print(json.dumps({"peak_growth_mb": _status_mb("VmHWM") - before, "decode_tokens": r.metrics["decode_tokens"],
                      "spans": len(r.run.spans)}))


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def memory() -> list[dict]:
    rows = []
    for model, pool in CASES:
        for decode in (DECODE, 16 * DECODE):
            for engine, timeline in (("simpy", True), ("simpy", False), ("replay", True), ("replay", False)):
                out = subprocess.run([sys.executable, __file__, "--memory-child", model, str(pool), str(decode), engine,
                                      str(int(timeline))], capture_output=True, text=True, check=True).stdout
                rows.append({"model": model, "decode": decode, "engine": engine, "timeline": timeline,
                             **json.loads(out.strip().splitlines()[-1])})
    return rows


def one_time_costs() -> dict:
    t0 = time.perf_counter()
    import numba  # noqa: F401
    t1 = time.perf_counter()
    from cmoe.sim.replay.warm import warm
    w = warm()
    return {"import_numba_s": t1 - t0, "first_calls_s": w}


def print_memory() -> None:
    print("\n| model | decode tokens | engine | timeline | spans | peak RSS growth MB | KB per decode token |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: |")
    for r in memory():
        print(f"| {r['model']} | {r['decode_tokens']} | {r['engine']} | {'yes' if r['timeline'] else 'no'} | "
              f"{r['spans']:,} | {r['peak_growth_mb']:.1f} | {r['peak_growth_mb'] * 1024 / r['decode_tokens']:.2f} |")


def main() -> None:
    if "--memory" in sys.argv:
        return print_memory()
    quick = "--quick" in sys.argv
    costs = one_time_costs()
    print(f"one-time: import numba {costs['import_numba_s']:.2f} s, compile or load the replay {costs['first_calls_s']:.2f} s")
    rows = speed(1 if quick else REPEATS)
    print("| model | policy | decode tokens | SimPy CPU s | replay CPU s | speed-up | SimPy tok/CPU-s | replay tok/CPU-s | metrics identical |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        a, b = r["tok_per_cpu_s"]
        print(f"| {r['model']} | {r['policy']} | {r['tokens']} | {r['simpy_s']:.3f} | {r['replay_s']:.4f} | "
              f"{r['simpy_s'] / r['replay_s']:.0f}x | {a:,.0f} | {b:,.0f} | {'yes' if r['identical'] else 'NO'} |")
    for model, _ in CASES:
        sel = [r for r in rows if r["model"] == model]
        s, p = sum(r["simpy_s"] for r in sel), sum(r["replay_s"] for r in sel)
        n = sum(r["tokens"] for r in sel)
        print(f"| {model} | all {len(sel)} | {n} | {s:.2f} | {p:.3f} | {s / p:.0f}x | {n / s:,.0f} | {n / p:,.0f} | "
              f"{'yes' if all(r['identical'] for r in sel) else 'NO'} |")
    if not quick:
        print_memory()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        m, pool, decode, engine, timeline = sys.argv[2:7]
        memory_child(m, float(pool), int(decode), engine, bool(int(timeline)))
    else:
        main()
