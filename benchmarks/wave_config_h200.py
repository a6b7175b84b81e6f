"""Which kernel configuration a launch wave of n experts wants (issues 13 and 15).

The expert kernel's configuration follows the batch's rows (`pick_config`; from 2026-12-07 a
graphed launch of at most 3 experts at 5-8 rows runs the M <= 4 one, `cmoe.executor.few_experts`):
from 5 rows on, `CONFIGS` run w13 on one warp a CTA and w2 on two, chosen for a layer whose 8
experts fill the machine. A loading policy's launch wave at batch 8 often holds 1-3 experts, and
there the 4-warp configuration of M <= 4 is the faster one: on the H200 (thirteenth session,
`results/lean-h200-13/call3-kernel_variants.json`) one expert at M = 8 took 38.5 us on it against
58.3, while the layer of 8 took 232.2 against 222.5. In the thirty-ninth session's validation
the one-expert launches at batch 8 took 64.9 us where the profile, fitted over `upper`'s full
launches, said 44.7.

This times, in one run, for M in --ms and n = 1..8 experts named in the slot table (the rest -1,
as a wave's table row is), a layer of 8 experts at top-2 (seeded routes; a wave computes only
its experts' pairs) under each configuration in --configs (default: the bucket's own and the
M <= 4 one), each the median of CUDA-graph replays rotating over 2 layers' slots (16 slots, so
nothing is served from L2), and checks every case against `moe_reference` in fp32. It prints,
per M, the largest n at which the few-expert configuration is still the faster one: the value of
`cmoe.executor.few_experts.FEW_EXPERTS` for that bucket.

    python3 benchmarks/wave_config_h200.py --out $OUT/wave-config            # ~1 min on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.moe_kernel import tiled_layout  # noqa: E402


def wave_tables(order: list[int], n: int, base: int) -> torch.Tensor:
    """A wave's slot-table row: the first n experts of `order` at slots base + e, the rest -1."""
    t = torch.full((8,), -1, dtype=torch.int32)
    for e in order[:n]:
        t[e] = base + e
    return t


def crossover(rows: list[dict], M: int, few: str, own: str) -> int:
    """The largest n (experts in the wave) up to which `few` ran no slower than `own` at every n:
    the switch point, 0 if `few` lost already at one expert."""
    by = {(r["config"], r["n"]): r["us"] for r in rows if r["M"] == M and r.get("us")}
    best = 0
    for n in range(1, 9):
        if (few, n) not in by or (own, n) not in by or by[(few, n)] > by[(own, n)]:
            break
        best = n
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/wave-config")
    ap.add_argument("--ms", default="8,16")
    args = ap.parse_args()
    from benchmarks.expert_kernel_h200 import graph_us, hbm_tbps
    from benchmarks.kernel_probe_h200 import FF, G, H, _experts, _rel          # Triton: the GPU's machine
    from cmoe.executor.kernels_triton import Workspace, moe_triton, pick_config
    from cmoe.executor.moe_kernel import moe_reference

    t0 = time.time()
    lay = tiled_layout(f"w4g{G}", H, FF)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = _experts(lay, 16, gen)
    configs = {"own": None, "few": pick_config(4)}
    res = {"hbm_copy_tbps": hbm_tbps(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "expert_bytes": lay.nbytes, "rows": [], "few_experts": {}}
    for M in [int(v) for v in args.ms.split(",")]:
        lg = torch.Generator().manual_seed(200 + M)
        x = torch.randn(M, H, generator=lg).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(8, generator=lg)[:2] for _ in range(M)]).int().cuda()
        wts = torch.rand(M, 2, generator=lg).cuda()
        ws = Workspace(M, 2, H, FF, 8, "cuda")
        # the experts in the order a wave would name them: most rows first (a wave of n holds n of them)
        counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=8)
        order = sorted(range(8), key=lambda e: (-int(counts[e]), e))
        for n in range(1, 9):
            tabs = [wave_tables(order, n, 8 * i).cuda() for i in range(2)]
            ref = moe_reference(x, ids, wts, tabs[0], pool, lay, out_dtype=torch.float32)
            rows_in = int(sum(int(counts[e]) for e in order[:n]))
            for name, cfg in configs.items():
                c = cfg or pick_config(M)
                err = _rel(moe_triton(x, ids, wts, tabs[0], pool, lay, workspace=ws, config=c, out_dtype=torch.float32),
                           ref)
                row = {"M": M, "n": n, "pairs": rows_in, "config": name, "rel_err": err, "ok": err < 5e-3}
                if row["ok"]:
                    row["us"] = graph_us([lambda t=t: moe_triton(x, ids, wts, t, pool, lay, workspace=ws, config=c)
                                          for t in tabs])
                    row["tbps"] = n * lay.nbytes / row["us"] / 1e6
                res["rows"].append(row)
                print(f"M={M:<3} n={n} pairs={rows_in:<3} {name:4} err {err:.1e} "
                      + (f"{row['us']:7.1f} us ({row['tbps']:.2f} TB/s)" if row["ok"] else "WRONG"), flush=True)
        res["few_experts"][M] = crossover(res["rows"], M, "few", "own")
        print(f"M={M}: the M <= 4 configuration is no slower up to {res['few_experts'][M]} experts a wave", flush=True)
    res["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "wave_config.json", json.dumps(res, indent=1))
    print(f"HBM copy {res['hbm_copy_tbps']:.2f} TB/s; took {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
