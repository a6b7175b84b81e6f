"""Markdown tables of benchmarks/lean_h200.py results (one or more results.json files).

    python benchmarks/lean_table.py benchmarks/results/lean-h200/*.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(paths: list[str]) -> None:
    runs = []
    for p in paths:
        d = json.load(open(p))
        for r in d["runs"]:
            if r.get("tag") == "transformers RMSNorm":
                continue
            runs.append(dict(r, commit=d["commit"], file=p.rsplit("/", 1)[-1]))
    ups = defaultdict(list)
    for r in runs:
        if r["policy"] == "upper":
            ups[(r["engine"], r["batch"])].append(r)
    print("| engine | batch | runs | tok/s (each run) | spread | ms/pass | HBM floor ms | x floor | host us/MoE layer |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for (eng, b), rs in sorted(ups.items(), key=lambda x: (x[0][1], x[0][0])):
        tps = [r["tokens_per_s"] for r in rs]
        ms = sum(r["pass_ms_mean"] for r in rs) / len(rs)
        fl = rs[0]["hbm_floor_ms"]
        print(f"| {eng} | {b} | {len(rs)} | {', '.join(f'{t:.1f}' for t in tps)} | {(max(tps) / min(tps) - 1) * 100:.1f}% | "
              f"{ms:.2f} | {fl:.2f} | {ms / fl:.2f} | {sum(r['host_work_us_per_layer'] for r in rs) / len(rs):.0f} |")
    print()
    print("| batch | pool GB | policy | tok/s | ms/pass | HBM floor ms | link-bound ms | x bound | loads/pass | host us/MoE layer | wait us/MoE layer |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [r for r in runs if r["policy"] != "upper" and r["engine"] == "lean"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["pool_gb"], r["policy"])):
        bound = max(r["hbm_floor_ms"], r["link_limit_ms"])
        print(f"| {r['batch']} | {r['pool_gb']:g} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['pass_ms_mean']:.2f} | "
              f"{r['hbm_floor_ms']:.2f} | {r['link_limit_ms']:.2f} | {r['pass_ms_mean'] / bound:.2f} | "
              f"{r['loads_per_pass']:.1f} | {r['host_work_us_per_layer']:.0f} | {r['host_sync_us_per_layer']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
