"""Do the CPU experts' pages set their speed? The same bytes on 4 KiB and on 2 MiB pages, in one
process (issues 13, 15).

The sessions before measured each process's CPU experts at a speed of its own (thirty-second
session: one-token medians 1.25-2.55 ms across processes under `OMP_WAIT_POLICY=ACTIVE`, at every
thread count, bound or not), often slow at a run's start and faster later. What a process fixes
once and keeps is its memory: the CPU twins are pageable buffers on 4 KiB pages (transparent huge
pages are `madvise` on the GPU hosts, so nothing asks for more), and on a virtual machine each TLB
miss walks the guest's and the host's tables. This measures, with the expert's bytes identical:
- isolated CPU experts (the executor's `ffn`, 8 random experts in the CPU layout, 32 back to back,
  1 and 4 tokens), each arm once from 4 KiB buffers (`torch.zeros`, as the store made them) and once
  from 2 MiB ones (`cmoe.core.hugepages.huge_zeros`, the same bytes copied), the order turned each
  round; beside each arm one core's Python speed (a fixed loop);
- with --executor, inside the executor on one built store: `static` at pool 26 batch 1 and pool 16
  batch 8, and `lfu-fallback` at pool 20 batch 8, each run once with the store's twins and once with
  a copy of them on huge pages, the order turned each round (c62ba87; since the store's twins ask
  for huge pages themselves, the copy is the small-page one): tokens/s and the decode CPU experts'
  median, and the median of each sixth of a run's CPU experts in time order (the slow starts).
The bytes each set has on huge pages (`huge_bytes`, from /proc/self/smaps) are recorded, so an arm
the kernel refused huge pages reads as such. Everything goes to --out as JSON; a line per figure.

    python benchmarks/cpu_pages_h200.py --out $OUT/pages.json [--executor --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.cpu_threads_h200 import facts  # noqa: E402
from cmoe.calibrate.measure import random_expert  # noqa: E402
from cmoe.calibrate.spans import decode_passes  # noqa: E402
from cmoe.core.hugepages import huge_bytes, huge_zeros, thp_mode  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.core.timeline import END, OP, START, STEP  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.kernels import ExpertViews, ffn  # noqa: E402
from cmoe.executor.layout import expert_layout, slot_size  # noqa: E402


def two_sets(spec, n: int) -> dict:
    """n random experts in the CPU layout on small pages, and the same bytes on huge pages."""
    lay = expert_layout("w4g128", spec.hidden, spec.expert_ffn)
    small, huge = [], []
    for i in range(n):
        b = torch.zeros(slot_size(lay), dtype=torch.uint8)
        random_expert(lay, 1 + i, torch.device("cpu"), "cpu", b)
        small.append(b)
        huge.append(huge_zeros(b.numel()).copy_(b))
    return {"small": small, "huge": huge, "views": {k: [ExpertViews(lay, b, "cpu") for b in v]
                                                    for k, v in (("small", small), ("huge", huge))}}


def sixths(ms: list[float]) -> list[float]:
    """The median of each sixth of a run's times, in time order."""
    parts = np.array_split(np.asarray(ms), 6) if len(ms) >= 6 else []
    return [float(np.median(p)) for p in parts]


def isolated(sets: dict, hidden: int, rounds: int, out: list) -> None:
    arms = [(mem, tok) for tok in (1, 4) for mem in ("small", "huge")]
    for rnd in range(rounds):
        for mem, tok in (arms if rnd % 2 == 0 else arms[::-1]):
            views = sets["views"][mem]
            x = torch.randn(tok, hidden, dtype=torch.bfloat16)
            ffn(x, views[0])
            ts = []
            for i in range(32):
                t0 = time.perf_counter()
                ffn(x, views[i % len(views)])
                ts.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            sum(range(200_000))
            py_ms = (time.perf_counter() - t0) * 1e3
            rec = {"part": "isolated", "round": rnd, "pages": mem, "tokens": tok, "median_ms": float(np.median(ts)),
                   "mean_ms": float(np.mean(ts)), "min_ms": float(np.min(ts)), "python_ms": py_ms}
            out.append(rec)
            print(f"isolated r{rnd} {mem:<5} tokens {tok}: median {rec['median_ms']:.3f} mean {rec['mean_ms']:.3f} "
                  f"min {rec['min_ms']:.3f} ms; python {py_ms:.2f} ms", flush=True)


ARMS = (("static", 26.0, 1), ("static", 16.0, 8), ("lfu-fallback", 20.0, 8))


def in_executor(spec_name: str, rounds: int, tokens: int, out: list, res: dict, save) -> None:
    from cmoe.executor.run import ExecConfig, build, prepare, run_policy
    where = {"spec_name": spec_name, "model_dir": None, "trace_src": f"synthetic:{spec_name}", "data": None}
    first = ExecConfig(policies=("static", "lfu-fallback"), pool_gb=16.0, batch=8, tokens=tokens, device="cuda")
    w, _ = prepare(cfg=first, **where)
    t0 = time.perf_counter()
    build(w, first)
    huge = w.store.cpu_twins                       # the store's own: on huge pages since 33rd session's change
    t1 = time.perf_counter()
    small = [torch.zeros(tuple(t.shape), dtype=t.dtype).copy_(t) for t in huge]   # fresh mappings: 4 KiB pages
    res["twins"] = {"build_s": t1 - t0, "small_copy_s": time.perf_counter() - t1,
                    "bytes": sum(t.numel() for t in small),
                    "huge_bytes": {"small": huge_bytes(small), "huge": huge_bytes(huge)}}
    print(f"built store and model in {t1 - t0:.0f} s, small-page twins in {res['twins']['small_copy_s']:.0f} s; "
          f"on huge pages: {res['twins']['huge_bytes']}", flush=True)
    run_policy(w, first, "upper")                                  # untimed warm-up
    arms = [(pol, pool, b, mem) for pol, pool, b in ARMS for mem in ("small", "huge")]
    for rnd in range(rounds):
        for pol, pool, b, mem in (arms if rnd % 2 == 0 else arms[::-1]):
            w.store.cpu_twins = small if mem == "small" else huge
            cfg = ExecConfig(policies=(pol,), pool_gb=pool, batch=b, tokens=tokens, device="cuda")
            wr, cfg = prepare(cfg=cfg, **where)
            wr.store, wr.model, wr.shims = w.store, w.model, w.shims
            r = run_policy(wr, cfg, pol)
            dec = decode_passes(r.log)
            cpu = [(s[END] - s[START]) / 1e3 for s in r.log.spans if s[OP] == "cpu_expert" and s[STEP] in dec]
            rec = {"part": "executor", "round": rnd, "pages": mem, "policy": pol, "pool_gb": pool, "batch": b,
                   "tok_s": r.metrics["tokens_per_s"], "cpu_experts": len(cpu),
                   "cpu_median_ms": float(np.median(cpu)) if cpu else None, "cpu_sixths_ms": sixths(cpu)}
            out.append(rec)
            six = " ".join(f"{v:.2f}" for v in rec["cpu_sixths_ms"])
            print(f"executor r{rnd} {pol:<12} pool {pool:g} b{b} {mem:<5}: {rec['tok_s']:.2f} tok/s, {len(cpu)} CPU experts "
                  f"median {rec['cpu_median_ms'] or 0:.3f} ms; sixths {six}", flush=True)
            save()
            del r
            torch.cuda.empty_cache()
    w.store.cpu_twins = huge


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iso-rounds", type=int, default=4)
    ap.add_argument("--executor", action="store_true", help="also the executor's runs on one built store")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the executor's runs")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens of each executor run")
    ap.add_argument("--spec", default="mixtral-8x7b")
    a = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "facts": facts() | {"thp_mode": thp_mode()}, "runs": []}
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "THP_"))}
    print(json.dumps(res["facts"] | {"env": res["env"]}, indent=1), flush=True)

    def save() -> None:
        write_text_atomic(a.out, json.dumps(res, indent=1))

    spec = preset(a.spec)
    sets = two_sets(spec, 8)
    res["isolated_huge_bytes"] = {k: huge_bytes(sets[k]) for k in ("small", "huge")}
    res["isolated_bytes"] = sum(b.numel() for b in sets["small"])
    print(f"isolated experts on huge pages: {res['isolated_huge_bytes']} of {res['isolated_bytes']} bytes each", flush=True)
    isolated(sets, spec.hidden, a.iso_rounds, res["runs"])
    save()
    del sets
    if a.executor:
        in_executor(a.spec, a.rounds, a.tokens, res["runs"], res, save)
    save()


if __name__ == "__main__":
    main()
