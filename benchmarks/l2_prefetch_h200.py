"""The L2 prefetch (`cmoe.executor.prefetch`) measured by itself: a latency-bound kernel of W us
(torch's spin kernel standing in for the norm or the attention) followed by a decode projection
that reads a weight from HBM, with and without the weight's first `frac` of each row prefetched on
a graph branch forked before the spin. Mixtral-8x7B's q/k/v (6144 x 4096) and o (4096 x 4096) in
bf16, M = 1 and 8, by cuBLAS (F.linear) and by `kernels_triton.gemv`; each timed as the median of
CUDA-graph replays rotating over 4 copies of the weight (nothing left in L2 from the last use).
The projection's time is the pair's time less the spin alone; its HBM floor is beside it.

    python3 benchmarks/l2_prefetch_h200.py --out $OUT/l2.json        # ~30 s on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.expert_kernel_h200 import graph_us, hbm_tbps  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.kernels_triton.gemv import gemv  # noqa: E402
from cmoe.executor.prefetch import Prefetcher  # noqa: E402

SHAPES = {"qkv": ((6144, 4096), (64, 128, 4)), "o": ((4096, 4096), (32, 256, 3))}   # (N, K), gemv (BN, BK, stages)
FRACS = (0.0, 0.25, 0.5, 0.75, 1.0)
WINDOWS_US = (0, 2, 4, 6, 8)
CYCLES_PER_US = 1980                  # the H200's SM clock under load; the spin's own time is measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tbps = hbm_tbps()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_copy_tbps": tbps, "rows": []}
    spin = {W: graph_us([lambda W=W: torch.cuda._sleep(W * CYCLES_PER_US)]) if W else 0.0 for W in WINDOWS_US}
    res["spin_us"] = spin
    pfs = {f: Prefetcher({"o": f, "qkv": f}, dev) for f in FRACS if f}
    for name, ((N, K), (bn, bk, st)) in SHAPES.items():
        ws = [(torch.randn(N, K, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(4)]
        floor = N * K * 2 / tbps / 1e6
        projs = {"torch": F.linear, "gemv": lambda x, w: gemv(x, w, bn=bn, bk=bk, stages=st)}
        for M in (1, 8):
            x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
            for W in WINDOWS_US:
                for pname, proj in projs.items():
                    line = []
                    for f in FRACS:
                        pf = pfs.get(f)

                        def step(w, pf=pf, W=W, proj=proj):
                            if pf is not None:
                                pf.branch(name, w)
                            if W:
                                torch.cuda._sleep(W * CYCLES_PER_US)
                            proj(x, w)
                            if pf is not None:
                                pf.join()
                        us = graph_us([lambda w=w: step(w) for w in ws])
                        res["rows"].append({"shape": name, "M": M, "window_us": W, "spin_us": spin[W], "proj": pname,
                                            "frac": f, "us": us, "proj_us": us - spin[W], "floor_us": floor})
                        line.append(f"{f:.2f}:{us - spin[W]:5.1f}")
                    print(f"{name:4} M={M} spin {spin[W]:4.1f} us {pname:5} proj us by frac  " + "  ".join(line)
                          + f"   floor {floor:4.1f}", flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
