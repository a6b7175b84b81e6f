"""Is the lean engine's slow host state the thread's core, the CPU, or the driver? (issues 13, 15)

The host lane ran for tens of passes at ~2.4 us a layer's `host_attention`, then at ~5, the pass
boundary 173-242 us against 553-601 (forty-eighth session, four H100 loans;
`benchmarks/boundary_states.py`). This runs the same policies in arms that alternate within one
process over one built store, the arms' order swapped every round (the host drifts over minutes,
so a fixed order would favour the arm that runs first):

    free     the thread as the OS schedules it
    pinned   `CMOE_PIN_HOST=core:N`, the thread held on one core around each run's passes
             (`cmoe.executor.affinity`)

Each run reports its tokens/s, host time per MoE layer, the share of its pass boundaries whose
next pass was slow (`--slow-us`, `cmoe.analysis.boundary.host_state`) and the median boundary;
and right before it, and again right after it (`after_cpu_us` and so on), the references the run's
state can be read against:

    cpu_us     a fixed pure-Python loop (`cmoe.core.cpu_ref`): the CPU's own speed, no driver
    record_us  one `cudaEventRecord` (the runtime's, through ctypes): the driver's submission path
    launch_us  one `cudaGraphLaunch` of a one-kernel graph through ctypes, as the compiled host
               program launches its layers' graphs
    replay_us  the same graph's replay through torch's wrapper

Forty-ninth session (an H100): pinned and free runs went slow together, so the core is not it. If
`cpu_us` rises with the slow share, the CPU is slower (a tenant, its clock); if only `record_us`,
`launch_us` and `replay_us` do, the driver or the link is. Fifty-first session (an H100, free arm,
8 rounds): none did, timed before the run (r -0.31 to 0.11); the CPU's own slow spells, which the
three driver calls followed (r 0.56-0.58), came and went apart from it. Hence the references after
the run too: a state the run ended in, caught before it passes.

    python benchmarks/affinity_probe.py --out $OUT/affinity.json --policies lru-prefetch,ondemand --pool 26 --rounds 4
    python benchmarks/affinity_probe.py --out $OUT/state.json --arms free --policies lru-prefetch,ondemand --pool 26 --rounds 8
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
from cmoe.core.errors import CmoeError  # noqa: E402
from cmoe.core.cpu_ref import cpu_ref_us  # noqa: E402
from cmoe.executor.affinity import ENV, pin_core, pinned_host  # noqa: E402
from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402

ARMS = ("free", "pinned")


def submit_references(reps: int = 200) -> dict:
    """(`record_us`, `launch_us`, `replay_us`): one `cudaEventRecord` and one `cudaGraphLaunch` of a
    one-kernel graph through the runtime, and one replay of that graph through torch, each the host's
    time over `reps` calls back to back (the GPU's queue takes them; synchronized after, untimed);
    the runtime's two None without it."""
    from cmoe.executor.cuda_rt import DISABLE_TIMING, Runtime
    x = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)                                               # warm, off the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    out = {"record_us": None, "launch_us": None, "replay_us": _per_call(g.replay, reps)}
    if (rt := Runtime.get()) is not None:
        ev, stream = rt.event(DISABLE_TIMING), torch.cuda.current_stream().cuda_stream
        try:
            out["record_us"] = _per_call(lambda: rt.record(ev, stream), reps)
        finally:
            rt.destroy(ev)
        ex = int(g.raw_cuda_graph_exec())
        out["launch_us"] = _per_call(lambda: rt.launch(ex, stream), reps)
    return out


def _per_call(call, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / reps * 1e6


REFS = ("cpu_us", "record_us", "launch_us", "replay_us")


def references() -> dict:
    """The four references, on the arm's core as the run's passes are."""
    with pinned_host():
        return {"cpu_us": cpu_ref_us(), **submit_references()}


def one_run(w, cfg, policy: str, rnd: int, arm: str, slow_us: float) -> dict:
    """One policy's run between two readings of the references, as a row of the JSON, printed."""
    ref = references()
    res = run_policy(w, cfg, policy)
    ref |= {f"after_{k}": v for k, v in references().items()}
    st = decode_stats(res, w.spec, float("nan"), 0.0)      # only its host figures are read
    slow, bound = host_state(res.log, slow_us)             # nan without a boundary: None in the JSON
    row = {"round": rnd, "arm": arm, "policy": policy, "tok_s": res.metrics["tokens_per_s"],
           "host_core": res.metrics["host_core"], "host_us_per_layer": st["host_work_us_per_layer"],
           "slow_share": None if np.isnan(slow) else slow, "boundary_us": None if np.isnan(bound) else bound, **ref}
    rec, lau = ("-" if ref[k] is None else f"{ref[k]:.2f}" for k in ("record_us", "launch_us"))
    print(f"round {rnd} {arm:<6} {policy:<12} {row['tok_s']:7.2f} tok/s host {row['host_us_per_layer']:6.1f} us/layer, "
          f"slow {slow:.0%}, boundary {bound:.0f} us; cpu {ref['cpu_us']:.0f} us, record {rec} us, launch {lau} us, "
          f"replay {ref['replay_us']:.2f} us; after: cpu {ref['after_cpu_us']:.0f} us, replay {ref['after_replay_us']:.2f} us",
          flush=True)
    return row


def summarize(runs: list, pols: list, arms: list) -> dict:
    """Each policy and arm's ranges, printed; and over every run, how each reference moves with
    the slow share (Pearson r; None where a column is constant or missing)."""
    summary = {}
    for p in pols:
        for arm in arms:
            mine = [x for x in runs if x["policy"] == p and x["arm"] == arm]
            h, t = ([x[k] for x in mine] for k in ("host_us_per_layer", "tok_s"))
            sl = [x["slow_share"] for x in mine if x["slow_share"] is not None]    # runs with a boundary
            summary[f"{p} {arm}"] = {"host_us_min": min(h), "host_us_max": max(h), "host_us_mean": float(np.mean(h)),
                                     "slow_share_min": min(sl, default=None), "slow_share_max": max(sl, default=None),
                                     "tok_s_min": min(t), "tok_s_max": max(t),
                                     "tok_s_spread_pct": (max(t) - min(t)) / float(np.mean(t)) * 100}
            print(f"{p:<12} {arm:<6} host {min(h):6.1f}-{max(h):6.1f} us/layer, tok/s {min(t):.2f}-{max(t):.2f} "
                  f"({summary[f'{p} {arm}']['tok_s_spread_pct']:.1f}%), slow "
                  + (f"{min(sl):.0%}-{max(sl):.0%}" if sl else "-"), flush=True)
    slow = np.array([np.nan if x["slow_share"] is None else x["slow_share"] for x in runs], float)
    for k in REFS:
        got = [_r(slow, runs, key) for key in (k, f"after_{k}")]
        summary[f"r slow_share {k}"], summary[f"r slow_share after_{k}"] = got
        print(f"r(slow share, {k}) = " + "; after the run ".join("-" if r is None else f"{r:.2f}" for r in got), flush=True)
    return summary


def _r(slow, runs: list, key: str) -> float | None:
    """Pearson r of the slow share and one reference over the runs with both (a row without the
    reference, an older file's, has none); None where under three runs have both or either is constant."""
    col = np.array([np.nan if x.get(key) is None else x[key] for x in runs], float)
    ok = ~np.isnan(col) & ~np.isnan(slow)
    return float(np.corrcoef(slow[ok], col[ok])[0, 1]) if ok.sum() > 2 and col[ok].std() and slow[ok].std() else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--policies", default="ondemand,oracle")
    ap.add_argument("--arms", default=",".join(ARMS), help="free, pinned or both, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--pool", type=float, default=20.0)
    ap.add_argument("--core", type=int, default=-1, help="the core to pin to (-1: the second of those allowed)")
    ap.add_argument("--slow-us", type=float, default=3.0, help="a pass whose host_attention takes this long is slow")
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - set(ARMS):
        raise SystemExit(f"affinity_probe.py: --arms {a.arms!r}: name free, pinned or both, comma-separated")
    free = sorted(os.sched_getaffinity(0))
    core = a.core if a.core >= 0 else free[min(1, len(free) - 1)]
    try:
        pin_core(f"core:{core}", set(free))                 # a core it may not use: refused before the build
    except CmoeError as e:
        raise SystemExit(f"affinity_probe.py: --core {core}: {e}") from None
    user = os.environ.pop(ENV, None)                        # the warm-up unpinned; the user's value back at the end
    pols = [p for p in a.policies.split(",") if p]
    cfg = ExecConfig(policies=("upper", *pols), pool_gb=a.pool, batch=1, tokens=a.tokens, device="cuda")
    w, cfg = prepare(spec_name="mixtral-8x7b", model_dir=None, trace_src="synthetic:mixtral-8x7b", data=None, cfg=cfg)
    build(w, cfg)
    run_policy(w, replace(cfg, tokens=4), "upper")                 # warm-up
    runs = []
    for r in range(a.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            os.environ[ENV] = f"core:{core}" if arm == "pinned" else "off"     # run_policy pins its passes
            runs += [one_run(w, cfg, p, r, arm, a.slow_us) for p in pols]
    os.environ.pop(ENV)
    if user is not None:
        os.environ[ENV] = user
    out = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "cores": free, "pinned_to": core,
           "arms": arms, "tokens": a.tokens, "pool_gb": a.pool, "slow_us": a.slow_us, "runs": runs,
           "summary": summarize(runs, pols, arms)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
