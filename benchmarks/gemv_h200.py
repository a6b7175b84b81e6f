"""The decode projections: `kernels_triton.gemv` against torch's F.linear (cuBLAS), in one run.

Mixtral-8x7B's q/k/v (6144 x 4096, stacked as the lean attention stacks them) and o (4096 x 4096)
projections in bf16 at M = 1, 4 and 8 rows, each call timed as the median of CUDA-graph replays
rotating over 4 copies of the weight (200 and 134 MB: nothing served from L2), with the HBM floor
(the weight's bytes over the measured copy bandwidth) beside it, and each kernel configuration's
error against the fp32 product checked first (a wrong one is reported, not timed). For q/k/v at
one row, also the input RMSNorm folded into the GEMV (`gemv(..., norm=)`, CMOE_QKV_NORM=1) against
the norm's own launch before it and against the GEMV alone, at the committed configuration.

    python3 benchmarks/gemv_h200.py --out $OUT/gemv.json        # ~20 s on the H200
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
from cmoe.executor.kernels_triton.gemv import config, gemv  # noqa: E402
from cmoe.executor.kernels_triton.norm import rms_norm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096)}
CONFIGS = [(16, 256, 4), (16, 512, 3), (32, 256, 3), (32, 128, 4), (64, 128, 4)]   # (BN, BK, stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tbps = hbm_tbps()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_copy_tbps": tbps, "rows": []}
    for name, (N, K) in SHAPES.items():
        ws = [(torch.randn(N, K, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(4)]
        floor = N * K * 2 / tbps / 1e6
        for M in (1, 4, 8):
            x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            row = {"shape": name, "M": M, "floor_us": floor,
                   "torch_us": graph_us([lambda w=w: F.linear(x, w) for w in ws])}
            for bn, bk, st in CONFIGS:
                err = ((gemv(x, ws[0], bn=bn, bk=bk, stages=st).float() - ref).norm() / ref.norm()).item()
                key = f"gemv_{bn}_{bk}_{st}"
                row[key + "_err"] = err
                if err < 1e-2:
                    row[key + "_us"] = graph_us([lambda w=w: gemv(x, w, bn=bn, bk=bk, stages=st) for w in ws])
            if name == "qkv" and M == 1:
                nw = (1 + 0.1 * torch.randn(K, generator=gen, device="cuda")).to(torch.bfloat16)
                c = config(N)
                row["norm_then_gemv_us"] = graph_us([lambda w=w: gemv(rms_norm(x, nw, 1e-5), w, None, *c) for w in ws])
                row["norm_folded_us"] = graph_us([lambda w=w: gemv(x, w, None, *c, norm=(nw, 1e-5)) for w in ws])
                row["gemv_alone_us"] = graph_us([lambda w=w: gemv(x, w, None, *c) for w in ws])
                print(f"qkv M=1: norm then GEMV {row['norm_then_gemv_us']:.1f} us, folded {row['norm_folded_us']:.1f}, "
                      f"GEMV alone {row['gemv_alone_us']:.1f}", flush=True)
            res["rows"].append(row)
            best = min((k for k in row if k.startswith("gemv") and k.endswith("_us")), key=row.get, default=None)
            print(f"{name:4} M={M}: torch {row['torch_us']:6.1f} us, best gemv {best} "
                  f"{row.get(best, float('nan')):6.1f} us, floor {floor:5.1f} us; "
                  + " ".join(f"{k[5:-3]} {v:.1f}" for k, v in row.items() if k.startswith("gemv") and k.endswith("_us")),
                  flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
