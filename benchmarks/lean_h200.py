"""Measured on a GPU: the lean engine (CUDA graphs, static KV cache, one launch per MoE layer)
against the reference engine (transformers' forward, per-expert torch int4 kernels), Mixtral-8x7B
shapes, W4A16 g128 experts with random seeded weights, a synthetic trace replayed (prompt 64,
N decode tokens).

Every row is read against two bounds measured on the same card in the same run:
- the HBM floor: the bytes a decode pass must read (resident non-expert weights, plus each
  expert it ran, once) over the measured device-to-device bandwidth;
- the link-bound limit: the run's own loads per decode pass times one expert's measured
  pinned host-to-device copy time.
Also per run: the host's own time per MoE layer (its `host_*` spans except the waits, i.e. issue,
planning and dispatch) and its wait at the read-back, from the measured host lane, and the
first-request cost (warm-up and graph capture).

Writes results.json under --out after every run (a run cut short keeps its figures).

    python benchmarks/lean_h200.py --out $OUT --tokens 256 --batches 1,4,8 --pools 16,20,26
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor_h200 import h2d_gbps, hbm_gbps, upper_floor_ms  # noqa: E402

from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402
from cmoe.executor.lean_steps import host_profile  # noqa: E402
from cmoe.policy.policies import POLICIES  # noqa: E402
from cmoe.core.timeline import STEP, STREAM, OP, START, END, write_parquet  # noqa: E402

HOST_WORK = ("host_attention", "host_route", "host_expert", "host_predict")


def under_env(name: str, value: str, run) -> None:
    """`run()` with the environment variable `name` set to `value`, restored after: the lean engine's
    switches for an A/B within one process (CMOE_PASS_SYNC=1: a sync at each end of every pass, as
    before decode passes were queued back to back; CMOE_RUNTIME_INPUTS=0: a pass's inputs by torch's
    ops instead of the runtime's calls)."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        run()
    finally:
        if was is None:
            os.environ.pop(name)
        else:
            os.environ[name] = was


def under_configs(path: Path, run) -> None:
    """`run()` with the expert kernel's CONFIGS buckets replaced by the per-M configurations in `path`
    (`kernel_variants_h200.py`'s "best_layer"), restored after."""
    from dataclasses import fields

    from cmoe.executor.kernels_triton import CONFIGS, KernelConfig
    best = json.loads(path.read_text())["best_layer"]
    known = {f.name for f in fields(KernelConfig)}
    for m, b in best.items():
        extra = sorted(set(b["config"]) - known)
        if extra:       # a configuration measured at another commit: refuse it rather than drop fields
            raise SystemExit(f"{path}: M = {m}'s configuration names fields this tree's KernelConfig lacks "
                             f"({', '.join(extra)}); it was measured at another commit")
    was = dict(CONFIGS)
    try:
        for m, b in best.items():
            CONFIGS[int(m)] = KernelConfig(**b["config"])
        run()
    finally:
        CONFIGS.clear()
        CONFIGS.update(was)


def phases_per_unit(ph: dict, profile: str | None) -> tuple[str, dict]:
    """A run's `host_phases` (us summed, with their counts) as (unit, us per unit): per graphed pass
    under `CMOE_HOST_PROFILE=pass`, else per MoE layer the Python step ran (the run's totals where
    it counted none)."""
    unit = "pass" if profile == "pass" else "layer"
    counts = {"layer": ph.get("layers", 0), "pass": ph.get("passes", 0)}
    n = max(counts[unit], 1)
    return unit, {k: v / n for k, v in ph.items() if k not in ("layers", "passes")}


def env_twins(a, ap) -> list[tuple[str, str, str]]:
    """(variable, value, tag) of each twin run the flags ask for: `--sync-ablation`,
    `--inputs-ablation`, `--wait-ablation`, then each NAME=VALUE of `--env-ablation` (checked here,
    before any model is built)."""
    twins = [t for on, t in ((a.sync_ablation, ("CMOE_PASS_SYNC", "1", "synced passes")),
                             (a.inputs_ablation, ("CMOE_RUNTIME_INPUTS", "0", "torch pass inputs")),
                             (a.wait_ablation, ("CMOE_WAIT", "spin", "spin waits"))) if on]
    for kv in filter(None, a.env_ablation.split(",")):
        name, eq, value = kv.partition("=")
        if not eq or not name:
            ap.error(f"--env-ablation: {kv!r} is not NAME=VALUE")
        twins.append((name, value, kv))
    return twins


def ablations(a, run) -> None:
    """The twins of `env_twins` and `--kernel-configs`, each right before `run`."""
    for name, value, tag in a.twins:
        under_env(name, value, lambda tag=tag: run(tag))
    if a.kernel_configs:
        under_configs(a.kernel_configs, lambda: run(f"kernel configs {a.kernel_configs.parent.name}"))


def kernel_profile(w, cfg, short: int = 4, long: int = 20) -> dict:
    """GPU time per decode token by kernel name, graph replays included (CUPTI reports their
    kernels): torch.profiler over an `upper` run of `short` and of `long` decode tokens, the
    difference over long - short tokens, so prefill and warm-up cancel out."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(tokens: int):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r = run_policy(w, replace(cfg, tokens=tokens), "upper")
            torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", 0) or getattr(e, "self_device_time_total", 0)
            if t and e.count:
                out[e.key] = (float(t), int(e.count))
        return out, r.metrics["tpot_ms_mean"]

    a, _ = kernels(short)
    b, tpot = kernels(long)
    n = long - short
    rows = []
    for k, (t, c) in b.items():
        t0, c0 = a.get(k, (0.0, 0))
        rows.append({"kernel": k[:120], "us_per_token": (t - t0) / n, "launches_per_token": (c - c0) / n})
    rows.sort(key=lambda r: -r["us_per_token"])
    total = sum(r["us_per_token"] for r in rows)
    print(f"--- kernels, b{cfg.batch}: {total:.0f} us of GPU time per decode token (tpot {tpot:.2f} ms "
          f"under the profiler)", flush=True)
    for r in rows[:30]:
        print(f"   {r['us_per_token']:8.1f} us {r['launches_per_token']:6.1f}x  {r['kernel'][:100]}", flush=True)
    return {"gpu_us_per_token": total, "tpot_ms_profiled": tpot, "rows": rows[:60]}


def decode_stats(r, spec, hbm: float, load_s: float) -> dict:
    log = r.log
    dec = {p for p, d, _, _ in log.pass_us if d}
    n = max(len(dec), 1)
    M = spec.num_moe_layers
    host = [s for s in log.spans if s[STREAM] == "host" and s[STEP] in dec]
    work = sum(s[END] - s[START] for s in host if s[OP] in HOST_WORK) / n / M
    sync = sum(s[END] - s[START] for s in host if s[OP] == "host_sync") / n / M
    loads = sum(1 for s in log.spans if s[OP] == "load" and s[STEP] in dec) / n
    pass_ms = [us / 1e3 for p, d, _, us in log.pass_us if d]
    # the LM head counts (before 2026-12-03 it was left out here: the floors were ~0.06 ms low)
    floor = upper_floor_ms(r, spec, hbm)
    return {"pass_ms_mean": float(np.mean(pass_ms)), "pass_ms_median": float(np.median(pass_ms)),
            "hbm_floor_ms": floor, "link_limit_ms": loads * load_s * 1e3, "loads_per_pass": loads,
            "host_work_us_per_layer": work, "host_sync_us_per_layer": sync,
            "capture_ms": (getattr(log, "capture_us", None) or 0.0) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--pools", default="16,20,26")
    ap.add_argument("--policies", default=",".join(p for p in POLICIES if p != "upper"))
    ap.add_argument("--engines", default="lean,hf")
    ap.add_argument("--hf-policies", default="upper", help="policies the reference engine also runs")
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--policy-tokens", type=int, default=0, help="decode tokens of the non-upper runs (0: --tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of lean upper per batch")
    ap.add_argument("--spec", default="mixtral-8x7b")
    ap.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs after this many seconds")
    ap.add_argument("--profile", default="", help="cProfile a 16-token lean run of these policies (comma list) at batch 1")
    ap.add_argument("--host-profile", action="store_true", help="time the host's step by phase (CMOE_HOST_PROFILE)")
    ap.add_argument("--pass-profile", action="store_true",
                    help="time the host's pass boundary by phase, the compiled host program running (CMOE_HOST_PROFILE=pass)")
    ap.add_argument("--norm-ablation", action="store_true",
                    help="also run lean upper with transformers' own RMSNorm (CMOE_FUSED_NORM=0)")
    ap.add_argument("--attn-ablation", action="store_true",
                    help="also run lean upper with transformers' own attention (CMOE_FAST_ATTN=0)")
    ap.add_argument("--wave-ablation", action="store_true",
                    help="run each policy also with its launch waves eager (CMOE_WAVE_GRAPHS=0), first")
    ap.add_argument("--sync-ablation", action="store_true",
                    help="lean: every run also with a sync at each pass's ends (CMOE_PASS_SYNC=1), right before it")
    ap.add_argument("--inputs-ablation", action="store_true",
                    help="lean: every run also with its pass inputs by torch's ops (CMOE_RUNTIME_INPUTS=0), right before it")
    ap.add_argument("--wait-ablation", action="store_true",
                    help="lean: every run also with the host polling each read-back's event (CMOE_WAIT=spin), right before it")
    ap.add_argument("--env-ablation", default="",
                    help="lean: every run also under each NAME=VALUE of this comma list, right before it (the "
                         "engine's switches: CMOE_ROUTE_MM=0 torch's router matmul, CMOE_ROPE_ATTEND=0 two "
                         "attention launches, CMOE_LEAN_LAYER=0 transformers' decoder layer, CMOE_GEMV=0 cuBLAS's "
                         "projections)")
    ap.add_argument("--timelines", action="store_true", help="write every run's timeline under --out")
    ap.add_argument("--live", action="store_true",
                    help="route live (no trace): the policies plan from the router's read-backs, each row a seeded "
                    "random prompt of --prompt tokens, the decode tokens the model's own argmax")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens a row with --live")
    ap.add_argument("--kernel-configs", type=Path, default=None,
                    help="a kernel_variants.json: each run also with its best per-M expert kernel configurations")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="lean upper: GPU time per decode token by kernel (torch.profiler, runs of 4 and 20 tokens)")
    ap.add_argument("--steps-ablation", action="store_true",
                    help="also run lean upper with torch's router top-k and residual sums (CMOE_FUSED_STEPS=0)")
    a = ap.parse_args()
    a.twins = env_twins(a, ap)
    if a.host_profile or a.pass_profile:
        os.environ["CMOE_HOST_PROFILE"] = "pass" if a.pass_profile else "1"
    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    # COMMIT as gpu_session.sh is called: the device's copy of the tree may carry an older .git
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
    res = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": commit, "spec": a.spec, "tokens": a.tokens, "live": a.live, "hbm_gbps": hbm_gbps(),
           "h2d_gbps_one_expert": h2d_gbps(93_585_408), "runs": []}
    print(f"HBM {res['hbm_gbps']:.0f} GB/s, H2D {res['h2d_gbps_one_expert']:.1f} GB/s", flush=True)
    engines = a.engines.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    pools = [float(p) for p in a.pools.split(",")]
    policies = [p for p in a.policies.split(",") if p]
    built: dict = {}
    model = shims = None

    def workload(engine: str, batch: int, pool: float, pols):
        nonlocal model, shims
        cfg = ExecConfig(policies=tuple(pols), pool_gb=pool, batch=batch, tokens=a.tokens, device="cuda", engine=engine)
        # a store already built is reused: prepare's host-memory check would count it again
        first = cfg if engine not in built else replace(cfg, policies=("upper",))
        w, _ = prepare(spec_name=a.spec, model_dir=None, trace_src=f"synthetic:{a.spec}", data=None, cfg=first)
        if engine not in built:
            t0 = time.perf_counter()
            build(w, cfg)
            built[engine] = w.store
            if model is None:
                model, shims = w.model, w.shims
            res[f"build_s_{engine}"] = time.perf_counter() - t0
            print(f"built the {engine} store ({w.store.packing}, {w.store.nbytes / 1e9:.1f} GB) in "
                  f"{res[f'build_s_{engine}']:.0f} s", flush=True)
        w.store, w.model, w.shims = built[engine], model, shims
        if a.live:                                       # the same prompts for every policy of a batch
            rng = np.random.default_rng(batch)
            w = replace(w, trace=None, prompts=rng.integers(0, model.config.vocab_size, (batch, a.prompt)).tolist())
        return w, cfg

    def one(engine, w, cfg, p, tag=""):
        t0 = time.perf_counter()
        r = run_policy(w, cfg, p)
        m = dict(r.metrics, engine=engine, wall_s=time.perf_counter() - t0, tag=tag,
                 **decode_stats(r, w.spec, res["hbm_gbps"], w.store.layout.nbytes / (res["h2d_gbps_one_expert"] * 1e9)))
        ph = getattr(r.log, "host_phases", None)
        if ph:
            unit, per = phases_per_unit(ph, host_profile())
            m[f"host_phases_us_per_{unit}"] = per
            print(f"   host phases, us per {unit}:", ", ".join(f"{k} {v:.1f}" for k, v in per.items()), flush=True)
        res["runs"].append(m)
        if a.timelines:                                  # every run's spans, for the host's steps offline
            name = f"timeline-{engine}-b{cfg.batch}-{cfg.pool_gb:g}-{p}" + (f"-{tag}" if tag else "")
            # no '=' (an ablation's tag): the device tool returns no file named with one
            write_parquet(r.log.spans, a.out / f"{name.replace(',', '').replace(' ', '_').replace('=', '_')}.parquet")
        print(f"{engine:<4} b{cfg.batch} {cfg.pool_gb:4.0f}GB {p:<13} {m['tokens_per_s']:8.1f} tok/s "
              f"{m['pass_ms_mean']:7.2f} ms/pass (floor {m['hbm_floor_ms']:.2f}, link {m['link_limit_ms']:.2f}) "
              f"loads/pass {m['loads_per_pass']:5.1f} host {m['host_work_us_per_layer']:5.1f} us/layer "
              f"sync {m['host_sync_us_per_layer']:6.1f} capture {m['capture_ms']:.0f} ms ({m['wall_s']:.0f} s) "
              f"calls {m['host_calls']} late {m['late_events']} program {m['host_program']}" + (f" [{tag}]" if tag else ""), flush=True)
        (a.out / "results.json").write_text(json.dumps(res, indent=1))
        return r

    def left() -> bool:
        return time.perf_counter() - t_start < a.budget_s

    for batch in batches:
        for engine in engines:
            pols = ["upper"] + (policies if engine == "lean" else [p for p in a.hf_policies.split(",") if p != "upper"])
            w, cfg = workload(engine, batch, pools[0], pols)
            run_policy(w, replace(cfg, tokens=4), "upper")        # warm-up: kernels, allocator
            if engine == "lean" and batch == batches[0] and a.profile:
                import cProfile
                import pstats
                for pp in a.profile.split(","):
                    wp, cp = workload(engine, batch, pools[0], [pp])
                    run_policy(wp, replace(cp, tokens=4), pp)
                    pr = cProfile.Profile()
                    pr.enable()
                    rr = run_policy(wp, replace(cp, tokens=16), pp)
                    pr.disable()
                    print(f"--- profile {pp}: {rr.metrics['tpot_ms_mean']:.2f} ms/token under the profiler", flush=True)
                    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
                    pr.dump_stats(a.out / f"profile-{pp}.prof")   # callers and callees, read with pstats
            if engine == "lean" and a.kernel_profile:
                res.setdefault("kernel_profile", {})[str(batch)] = kernel_profile(w, cfg)
                (a.out / "results.json").write_text(json.dumps(res, indent=1))
            if engine == "lean" and a.norm_ablation:
                under_env("CMOE_FUSED_NORM", "0", lambda: one(engine, w, cfg, "upper", tag="transformers RMSNorm"))
            if engine == "lean" and a.attn_ablation:
                under_env("CMOE_FAST_ATTN", "0", lambda: one(engine, w, cfg, "upper", tag="transformers attention"))
            if engine == "lean" and a.steps_ablation:
                under_env("CMOE_FUSED_STEPS", "0", lambda: one(engine, w, cfg, "upper", tag="torch router and residual"))
            reps = a.repeats if engine == "lean" else 1
            tok = a.tokens if engine == "lean" else min(a.tokens, a.hf_tokens)
            for i in range(reps):
                if not left():
                    break
                if engine == "lean":
                    ablations(a, lambda t: one(engine, w, replace(cfg, tokens=tok), "upper", tag=f"{t}, repeat {i}"))
                r = one(engine, w, replace(cfg, tokens=tok), "upper", tag=f"repeat {i}")
                if batch == 1 and i == 0:
                    write_parquet(r.log.spans, a.out / f"timeline-{engine}-b1-upper.parquet")
                del r
            others = pols[1:]
            for pool in (pools if engine == "lean" else pools[:1]):
                for p in others:
                    if not left():
                        break
                    w2, cfg2 = workload(engine, batch, pool, [p])
                    ptok = min(tok, a.policy_tokens) if a.policy_tokens else tok
                    if a.wave_ablation and engine == "lean":
                        under_env("CMOE_WAVE_GRAPHS", "0",
                                  lambda: one(engine, w2, replace(cfg2, tokens=ptok), p, tag="eager waves"))
                    if engine == "lean":
                        ablations(a, lambda t: one(engine, w2, replace(cfg2, tokens=ptok), p, tag=t))
                    r = one(engine, w2, replace(cfg2, tokens=ptok), p)
                    if batch == 1 and pool == pools[0] and p == "commit":
                        write_parquet(r.log.spans, a.out / f"timeline-{engine}-b1-commit.parquet")
                    del r
    res["wall_s"] = time.perf_counter() - t_start
    (a.out / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
