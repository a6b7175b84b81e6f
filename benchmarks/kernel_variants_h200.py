"""Variants of the expert kernel against the committed configuration, in one run (issue 14).

For each M and each variant (the committed `pick_config(M)` with some fields replaced), on
Mixtral-8x7B shapes (W4A16 g128, random codes in the tiled layout): the w13 launch alone (with
split13 > 1 its reduction too), the w2 launch alone, one expert through `moe_triton` and a layer of
8 experts at top-2, each the median of CUDA-graph replays rotating over slots so that nothing is
served from L2 (`expert_kernel_h200.graph_us`); and the error of the expert and of the layer
against `moe_reference` in fp32 (a variant that misses the committed tolerance is reported, not
timed). Effective bandwidth = the bytes read (codes and (scale, zero) pairs) over the time.

    python3 benchmarks/kernel_variants_h200.py --out $OUT/variants            # ~1-2 min on the H200
    python3 benchmarks/kernel_variants_h200.py --launch-only --ms 1           # for ncu: launches only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.expert_kernel_h200 import graph_us, hbm_tbps  # noqa: E402
from benchmarks.kernel_probe_h200 import (FF, G, H, _experts, _rel, one_expert_inputs,  # noqa: E402
                                          one_expert_launches, references)
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.moe_kernel import tiled_layout  # noqa: E402

# name -> the fields replaced in the committed configuration
VARIANTS: dict[str, dict] = {
    "committed": {},
    "split13-2": dict(split13=2, cu13=0, cu2=0),          # split-K of the Triton w13
    "split13-4": dict(split13=4, cu13=0, cu2=0),
    # the CUDA C++ kernel (kernels_cuda, twelfth session): warps a CTA for w13 (cu13) and w2 (cu2),
    # w2's 16-row tiles a warp (cut2) and split-K over CTAs (cus2), x loaded with the unit's weights
    # (cux13, cux2) or per block; cu13 = cu2 = 0 is the Triton kernel alone
    "triton": dict(cu13=0, cu2=0),
    "cuda-f": dict(cu13=4, cu2=4, cut2=4, cus2=4, cux13=False, cux2=True),
    "cuda-d": dict(cu13=1, cu2=2, cut2=2, cus2=4, cux13=False, cux2=True),
    "cuda-d2w": dict(cu13=2, cu2=2, cut2=2, cus2=4, cux13=False, cux2=True),
    "cuda-f-x13": dict(cu13=4, cu2=4, cut2=4, cus2=4, cux13=True, cux2=True),
    "cuda-f-x2off": dict(cu13=4, cu2=4, cut2=4, cus2=4, cux13=False, cux2=False),
    "cuda-a": dict(cu13=4, cu2=4, cut2=2, cus2=4, cux13=False, cux2=True),
    "cuda-f-s8": dict(cu13=4, cu2=4, cut2=4, cus2=8, cux13=False, cux2=True),
    "cuda-d-t4": dict(cu13=1, cu2=2, cut2=4, cus2=4, cux13=False, cux2=True),
    # thirteenth session: w2 a programmatic dependent of w13 (its first weights load during w13's end)
    "cuda-f-x13-pdl": dict(cu13=4, cu2=4, cut2=4, cus2=4, cux13=True, cux2=True, cupdl=True),
    "cuda-d-pdl": dict(cu13=1, cu2=2, cut2=2, cus2=4, cux13=False, cux2=True, cupdl=True),
    "cuda-f-x13-pdl-s8": dict(cu13=4, cu2=4, cut2=4, cus2=8, cux13=True, cux2=True, cupdl=True),
}
# measured in the eighth session at 0569aec, and removed after (slower at every M): the (scale, zero)
# pairs loaded in their own unit and streamed by the pipeliner (spd13 = spd2 = 0 with stg13 = stg2 =
# 3 or 4), alone, with split13 = 2, and with bn13 = 16 on one warp
# measured in the ninth session (H200, results/lean-h200-9/call1-variants.json), and removed after
# (slower at every M, alone and with split13 = 2): sum(x) per group from a table made before the
# launch instead of the dot with ones (gsum13 = gsum2 = True, 1e587ca); one expert at M = 1 took
# 50.8 us against 45.0 (w13 32.1 against 30.8, w2 15.3 against 13.6)
# measured in the eleventh session (results/lean-h200-11/kernel_variants*.json), and removed after:
# the matmuls on CUDA cores (gemv13 / gemv2, `_expert_gemv` of 6518921 and 3801b7b):
# 1, 2, 4 or 8 weight rows a thread, 1-4 warps, split13 1-4, stages 3-5 or a register prefetch,
# 1-4 batch rows a chunk; at M = 1 w13 29.3-59.4 us against 31.3, w2 14.6-20.1 against 13.6, and no
# layer faster than the committed one at any M from 1 to 8 (from M = 2 on 1.4-9.5x slower)
# measured in the twelfth session (results/lean-h200-12/), and dropped from this list: call 1, the
# CUDA kernel's w13 on 2 or 8 warps with x with the unit (24.2-27.1 us at M = 1-8 against
# 22.4-23.8 on 4), w2 on 8 warps split 2 (layers within 0.3% of cuda-f's) and w2 split 16 (slower
# layers); call 2 (0820d57), a ring loading 2-3 units ahead and launch bounds of 4-6 CTAs a
# multiprocessor (M = 1: w13 25.0-39.8 us against 21.7, w2 12.3-26.8 against 11.6); call 6
# (ce8df29), the weights and pairs brought by bulk copies (1 KB and 64 B runs on per-stage
# mbarriers, 2-5 stages a warp, bk-a..bk-g): right, but w13 26.2-47.7 us against 22.6-23.8 and
# every layer 2-37% slower than the committed one
# measured in the fourteenth session (results/lean-h200-14/call1-kernel_variants.json) and removed after:
# the route inside both CUDA launches (curt, 27518bf: each CTA sorts the <= 128 pairs in shared memory,
# w13 zeroes acc, no route launch): one expert at M = 1 35.4 us against 35.7, but every layer slower
# (M = 1-16: 65.3/97.7/166.7/228.4/257.6 us against 64.1/92.9/150.4/221.4/235.2)
# measured in the thirty-second session on an H100 (results/lean-h100-32/call1-kernel_variants.json)
# and removed after: w13 and w2 in one launch (`moe_fused`, d3ed554: a CTA computes one 128-column
# unit of h, K split over its warps, then adds w2's matching unit times it into acc by atomics; no
# grid dependency, fuse8/fuse16 = 8 or 16 warps a CTA, w2 steps of 1, 2 or 4 tiles): right, and the
# one launch streamed the expert at 2.39 TB/s (39.2 us, 79% of the card's 3.04 TB/s copy) against
# w13 alone's 2.16, but one expert (route, launch, copy) took 42.1 us against 41.2 for the
# committed pair, whose dependent w2 already hides w13's tail, and every layer was slower at M = 1-16
# (best fused 74.6/120.8/200.2/277.7/294.8 us against 73.1/107.0/171.0/264.5/270.6): its 112 CTAs
# an expert leave 20 of the 132 multiprocessors idle, and at 16 warps a CTA a layer's second
# expert waits for a second wave


def _write(res: dict, out: Path, t0: float) -> None:
    res["seconds"] = time.time() - t0
    res["best_layer"] = best_layer(res["rows"])
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "kernel_variants.json", json.dumps(res, indent=1))


def best_layer(rows: list) -> dict:
    """Per M, the right variant whose layer of 8 experts ran fastest (what the executor launches):
    {M: {"variant", "layer_us", "config"}}; `lean_h200.py --kernel-configs` runs `upper` with them."""
    best: dict = {}
    for r in rows:
        if r["ok"] and (r["M"] not in best or r["layer_us"] < best[r["M"]]["layer_us"]):
            best[r["M"]] = {"variant": r["variant"], "layer_us": r["layer_us"], "config": r["config"]}
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/variants")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--launch-only", action="store_true", help="launch w13 and w2 of each variant twice (ncu)")
    args = ap.parse_args()
    from cmoe.executor.kernels_triton import moe_triton, pick_config

    t0 = time.time()
    names = args.variants.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    lay = tiled_layout(f"w4g{G}", H, FF)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = _experts(lay, 4 if args.launch_only else 16, gen)
    tables = [torch.tensor([r], dtype=torch.int32, device="cuda") for r in range(4)]
    lay_tables = [torch.arange(8, dtype=torch.int32, device="cuda") + 8 * i for i in range(2)]
    b13 = lay.part("w13").nbytes + lay.part("w13_sz").nbytes
    b2 = lay.part("w2").nbytes + lay.part("w2_sz").nbytes
    data = one_expert_inputs(ms, gen)
    cfgs = {(n, M): replace(pick_config(M), **VARIANTS[n]) for n in names for M in ms}
    w13, w2 = one_expert_launches(data, pool, lay)

    with ThreadPoolExecutor(16) as ex, triton.AsyncCompileMode(ex, ignore_errors=True):
        for (n, M), c in cfgs.items():
            w13(M, c, tables[0], warmup=True)
            w2(M, c, tables[0], warmup=True)
    print(f"compiled {len(cfgs)} configurations in {time.time() - t0:.0f} s", flush=True)
    if args.launch_only:
        for (n, M), c in cfgs.items():
            for i in range(2):
                w13(M, c, tables[i])
                w2(M, c, tables[i])
            torch.cuda.synchronize()
            print("launched", n, M, c, flush=True)
        return

    res = {"hbm_copy_tbps": hbm_tbps(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "bytes": {"w13": b13, "w2": b2, "expert": lay.nbytes}, "rows": []}
    for M in ms:
        x, wts, ws = data[M]
        ids1, ref1, ids2, w2t, wsl, ref2 = references(M, x, wts, pool, lay, tables, lay_tables)
        nexp = len(set(ids2.reshape(-1).tolist()))
        for n in names:
            c = cfgs[(n, M)]
            e1 = _rel(moe_triton(x, ids1, wts, tables[0], pool, lay, workspace=ws, config=c, out_dtype=torch.float32),
                      ref1)
            e2 = _rel(moe_triton(x, ids2, w2t, lay_tables[0], pool, lay, workspace=wsl, config=c,
                                 out_dtype=torch.float32), ref2)
            row = {"M": M, "variant": n, "config": asdict(c), "expert_rel_err": e1, "layer_rel_err": e2,
                   "ok": max(e1, e2) < (1e-2 if (c.deq or c.deq2) else 5e-3)}
            if row["ok"]:
                row["w13_us"] = graph_us([lambda t=t: w13(M, c, t) for t in tables])
                row["w2_us"] = graph_us([lambda t=t: w2(M, c, t) for t in tables])
                row["expert_us"] = graph_us([lambda t=t: moe_triton(x, ids1, wts, t, pool, lay, workspace=ws, config=c)
                                             for t in tables])
                row["layer_us"] = graph_us([lambda t=t: moe_triton(x, ids2, w2t, t, pool, lay, workspace=wsl,
                                                                   config=c) for t in lay_tables])
                row["w13_tbps"] = b13 / row["w13_us"] / 1e6
                row["w2_tbps"] = b2 / row["w2_us"] / 1e6
                row["expert_tbps"] = lay.nbytes / row["expert_us"] / 1e6
                row["layer_tbps"] = nexp * lay.nbytes / row["layer_us"] / 1e6
            res["rows"].append(row)
            print(f"M={M:<3} {n:18} err {e1:.1e}/{e2:.1e} "
                  + (f"w13 {row['w13_us']:6.1f} us ({row['w13_tbps']:.2f}) w2 {row['w2_us']:5.1f} ({row['w2_tbps']:.2f}) "
                     f"expert {row['expert_us']:6.1f} ({row['expert_tbps']:.2f}) layer {row['layer_us']:6.1f} "
                     f"({row['layer_tbps']:.2f} TB/s)" if row["ok"] else "WRONG"), flush=True)
            _write(res, Path(args.out), t0)               # after every row: a run cut short keeps its rows
    _write(res, Path(args.out), t0)
    print(f"HBM copy {res['hbm_copy_tbps']:.2f} TB/s; took {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
