"""The expert kernels at one row under Nsight Compute (issue 14): what bounds them, read off counters.

Launches, at M = 1 on one Mixtral-8x7B expert (W4A16 g128, random codes in the tiled layout),
the committed w13 and w2 kernels (`CONFIGS[1]`) and, for the same bytes and grid, the probe's
pipelined `stream` (its loop with 4 stages, 3.74 TB/s in the seventh session), each `--reps`
times, rotating over 4 slots so that no launch is served from L2. `gpu_session.sh ncu` runs it
under `ncu --set full` and keeps the details page (throughputs, warp stall reasons, pipe use)
and the SASS source page with its sampled stalls per instruction. Without ncu it only runs
the launches (`--time` adds CUDA-graph timings of each, the same as `kernel_probe_h200.py`'s).

    ncu --clock-control none --set full -k regex:'_expert_mm|_stream' --launch-skip 6 \
        --launch-count 3 -o $OUT/k python3 benchmarks/kernel_ncu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_probe_h200 import (FF, G, H, _experts, _stream, one_expert_inputs,  # noqa: E402
                                          one_expert_launches)
from cmoe.executor.layout import slot_size  # noqa: E402
from cmoe.executor.moe_kernel import tiled_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    from benchmarks.expert_kernel_h200 import graph_us
    from cmoe.executor.kernels_triton import CONFIGS

    lay = tiled_layout(f"w4g{G}", H, FF)
    sb = slot_size(lay)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = _experts(lay, 4, gen)
    tables = [torch.tensor([r], dtype=torch.int32, device="cuda") for r in range(4)]
    w13, w2 = one_expert_launches(one_expert_inputs([1], gen), pool, lay)
    cfg = CONFIGS[1]
    sink = torch.empty(2 * FF * 64, dtype=torch.int32, device="cuda")

    def stream(t):
        kb = H // 128
        _stream[(triton.cdiv(FF, 32), 1)](pool, sb, t, sink, lay.part("w13").offset, lay.part("w13_sz").offset,
                                          FF, kb, kb, BN=32, W13=True, UNR=1, STG=4, num_warps=2, num_stages=3)

    calls = {"w13": lambda t: w13(1, cfg, t), "w2": lambda t: w2(1, cfg, t), "stream": stream}
    for name, call in calls.items():
        for i in range(args.reps):
            call(tables[i % 4])
        torch.cuda.synchronize()
        if args.time:
            print(name, round(graph_us([lambda t=t: call(t) for t in tables]), 2), "us", flush=True)
    print("launched", {k: args.reps for k in calls}, "config", cfg)


if __name__ == "__main__":
    main()
