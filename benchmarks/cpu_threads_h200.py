"""Why a CPU expert's speed moves from run to run on the GPU machine's host (issue 15), and whether
the CPU's thread count steadies it.

The twenty-ninth session's validation (H100, c212d9a) saw each run's CPU experts at one speed of
its own: fitted as run effect x expert effect over 236 (layer, expert) pairs seen in several runs,
the run effects spread 0.68-1.33x while the experts' own spread was 7.5% (log sd), and one-token
experts ran 1.10 ms in one run and 1.76 ms in the next of the same batch. A per-run state, not the
memory an expert sits in. Candidates: how torch's intra-op threads (one per core by default) land
on cores beside the engine's own threads and the CUDA driver's (one busy core slows a parallel
region to its slowest thread), the link's copies reading the same DRAM, the VM's neighbours.

This measures, in one process over one built store (Mixtral-8x7B shapes, W4A16 g128, CPU twins):
- the machine's facts (cores, NUMA nodes, the kernel's NUMA balancing, transparent huge pages);
- isolated CPU experts (the executor's own `ffn` over 8 random experts in the CPU layout, 32
  back to back, 1 and 4 tokens), at each thread count of --threads, with and without the link
  busy (host-to-device copies of pinned experts queued on a side stream), over --iso-rounds
  rounds whose arms' order turns each round (the host drifts over minutes); with
  --isolated-only nothing else, so other processes can repeat it under other OpenMP settings;
- inside the executor: `static` (pool 16) and `lfu-fallback` (pool 20) at batch 8, each thread
  count per round, the order turned each round: tokens/s and the decode CPU experts' mean and
  median (--batch and --pools set others: batch 1 at pool 26 puts CPU experts far apart).
Beside each isolated arm, one core's Python speed (a fixed loop), to tell the whole CPU slowing
from the experts' threads slowing.
Beside each arm also the host's load while it ran (`cmoe.calibrate.host_load`, a snapshot before
and after: cores busy with other processes' work, with interrupts, stolen), the slow stretches'
suspects.
Everything is written to --out as JSON; one line per measurement is printed.

    python benchmarks/cpu_threads_h200.py --out $OUT/cpu_threads.json --threads 16,15,14,8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.omp_wait import cores  # noqa: E402  (before torch: the CPU mask before libgomp binds)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from cmoe.calibrate.host_load import HZ, available, snapshot, windows  # noqa: E402
from cmoe.calibrate.spans import decode_passes  # noqa: E402
from cmoe.core.timeline import END, OP, START, STEP  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.calibrate.measure import random_cpu_experts  # noqa: E402
from cmoe.executor.kernels import ffn  # noqa: E402
from cmoe.executor.layout import expert_layout, slot_size  # noqa: E402
from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402


def facts() -> dict:
    """What the host is: cores, NUMA nodes and their CPUs, NUMA balancing, huge pages, torch's threads."""
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError as e:
            return f"unreadable ({e.strerror})"
    nodes = {n.name: read(f"{n}/cpulist") for n in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        lscpu = []
    keep = ("Model name", "Socket", "Core", "Thread", "NUMA", "L3", "CPU(s)", "MHz")
    return {"cpu_count": os.cpu_count(), "affinity": cores(), "affinity_now": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
            "torch_interop": torch.get_num_interop_threads(), "nodes": nodes,
            "numa_balancing": read("/proc/sys/kernel/numa_balancing"),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "lscpu": [ln for ln in lscpu if ln.strip().startswith(keep)],
            "parallel_info": torch.__config__.parallel_info().splitlines()}


def cpu_experts(spec, n: int) -> tuple[list, list]:
    """n random experts of the spec's shapes in this CPU's layout (`random_expert`), and each one's
    bytes in the GPU kernel's layout in pinned memory (what the link copies): built here, without
    the whole store, so another process (other OpenMP settings) measures the same in seconds."""
    lay = expert_layout("w4g128", spec.hidden, spec.expert_ffn)
    return random_cpu_experts(lay, n), [torch.empty(slot_size(lay), dtype=torch.uint8, pin_memory=True) for _ in range(n)]


def load_line(rec: dict, before, after=None) -> str:
    """rec gets the host's load from the `snapshot` `before` to `after` (default: now)
    (`host_load.windows`: cores busy with other processes, interrupts, stolen; two snapshots, not
    the sampler, whose 0.1 s windows an isolated arm is shorter than; over an arm of ~30 ms, 100 Hz
    ticks resolve `other` to about a third of a core); the line's words."""
    if before is None:
        return ""
    (m,) = windows([before, after or snapshot()], HZ)
    rec["host_load"] = m | {"other": max(m["other"], 0.0)}
    return f"; host other {rec['host_load']['other']:.2f} irq {m['irq']:.2f} steal {m['steal']:.2f} cores"


def _snap():
    return snapshot() if available() else None


def isolated(views: list, pinned: list, hidden: int, threads: list[int], rounds: int, out: list) -> None:
    """32 CPU experts back to back per arm (cycling over `views`, each larger than the L3 cache);
    the link busy (host-to-device copies of `pinned` queued on a side stream) or not."""
    dst = torch.empty(pinned[0].numel(), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    arms = [(th, tok, busy) for th in threads for tok in (1, 4) for busy in (False, True)]
    for rnd in range(rounds):
        for th, tok, busy in (arms if rnd % 2 == 0 else arms[::-1]):
            torch.set_num_threads(th)
            x = torch.randn(tok, hidden, dtype=torch.bfloat16)
            ffn(x, views[0])                                      # the pool at this size, once
            if busy:                                              # ~60 loads: longer than the 32 experts
                with torch.cuda.stream(side):
                    for i in range(60):
                        dst.copy_(pinned[i % len(pinned)], non_blocking=True)
            ts, e0 = [], _snap()
            for i in range(32):
                t0 = time.perf_counter()
                ffn(x, views[i % len(views)])
                ts.append((time.perf_counter() - t0) * 1e3)
            e1 = _snap()                                           # the arm's end, before the sync
            done = side.query() if busy else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sum(range(200_000))                                   # one core's Python speed now
            py_ms = (time.perf_counter() - t0) * 1e3
            rec = {"part": "isolated", "round": rnd, "threads": th, "tokens": tok, "link_busy": busy,
                   "copies_outlasted": (not done) if busy else None,
                   "mean_ms": float(np.mean(ts)), "median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)),
                   "python_ms": py_ms}
            out.append(rec)
            print(f"isolated r{rnd} threads {th:2d} tokens {tok} link {'busy' if busy else 'idle'}: "
                  f"mean {rec['mean_ms']:.3f} median {rec['median_ms']:.3f} min {rec['min_ms']:.3f} ms; python {py_ms:.2f} ms"
                  + load_line(rec, e0, e1), flush=True)


def in_executor(where: dict, built, threads: list[int], rounds: int, tokens: int, out: list, save=None,
                batch: int = 8, pools: tuple = (16.0, 20.0)) -> None:
    """`static` and `lfu-fallback` at their pools (`pools`) and `batch`, every thread count each
    round; the CPU experts' figures over the decode passes (the prefill's have many tokens)."""
    arms = [(th, pol, pool) for th in threads for pol, pool in zip(("static", "lfu-fallback"), pools)]
    for rnd in range(rounds):
        for th, pol, pool in (arms if rnd % 2 == 0 else arms[::-1]):
            torch.set_num_threads(th)
            cfg = ExecConfig(policies=(pol,), pool_gb=pool, batch=batch, tokens=tokens, device="cuda")
            w, cfg = prepare(cfg=cfg, **where)
            w.store, w.model, w.shims = built
            e0 = _snap()
            r = run_policy(w, cfg, pol)
            dec = decode_passes(r.log)
            cpu = [(s[END] - s[START]) / 1e3 for s in r.log.spans if s[OP] == "cpu_expert" and s[STEP] in dec]
            rec = {"part": "executor", "round": rnd, "threads": th, "policy": pol, "pool_gb": pool, "batch": batch,
                   "passes": "decode",
                   "tok_s": r.metrics["tokens_per_s"], "cpu_experts": len(cpu),
                   "cpu_mean_ms": float(np.mean(cpu)) if cpu else None, "cpu_median_ms": float(np.median(cpu)) if cpu else None}
            out.append(rec)
            got = f"mean {rec['cpu_mean_ms']:.3f} median {rec['cpu_median_ms']:.3f} ms" if cpu else "-"
            print(f"executor r{rnd} threads {th:2d} {pol:<12} pool {pool:g}: {rec['tok_s']:.2f} tok/s, "
                  f"{len(cpu)} CPU experts {got}" + load_line(rec, e0), flush=True)
            if save is not None:
                save()                                            # a run cut short keeps what it measured
            del r
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", default="16,15,14,8")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the executor's runs")
    ap.add_argument("--iso-rounds", type=int, default=4, help="rounds of the isolated experts (cheap)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens of each executor run")
    ap.add_argument("--spec", default="mixtral-8x7b")
    ap.add_argument("--batch", type=int, default=8, help="the executor runs' batch")
    ap.add_argument("--pools", default="16,20", help="the executor runs' pools (GB): static's, lfu-fallback's")
    ap.add_argument("--isolated-only", action="store_true", help="8 experts built here, no store, no executor runs")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    res = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "facts": facts(), "runs": []}
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    print(json.dumps(res["facts"] | {"env": res["env"]}, indent=1), flush=True)
    spec = preset(a.spec)
    views, pinned = cpu_experts(spec, 8)
    isolated(views, pinned, spec.hidden, threads, a.iso_rounds, res["runs"])
    write_text_atomic(a.out, json.dumps(res, indent=1))
    if a.isolated_only:
        return
    del views, pinned
    where = {"spec_name": a.spec, "model_dir": None, "trace_src": f"synthetic:{a.spec}", "data": None}
    pools = tuple(float(x) for x in a.pools.split(","))
    if len(pools) != 2:
        sys.exit(f"--pools takes two sizes (static's, lfu-fallback's), not {a.pools!r}")
    first = ExecConfig(policies=("static", "lfu-fallback"), pool_gb=pools[0], batch=a.batch, tokens=a.tokens, device="cuda")
    w, _ = prepare(cfg=first, **where)
    t0 = time.perf_counter()
    build(w, first)
    print(f"built store and model in {time.perf_counter() - t0:.0f} s", flush=True)
    run_policy(w, first, "upper")                                  # untimed warm-up
    in_executor(where, (w.store, w.model, w.shims), threads, a.rounds, a.tokens, res["runs"],
                lambda: write_text_atomic(a.out, json.dumps(res, indent=1)), a.batch, pools)
    write_text_atomic(a.out, json.dumps(res, indent=1))

if __name__ == "__main__":
    main()
