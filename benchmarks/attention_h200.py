"""The decode attention's one launch (`kernels_triton.attention.decode_attention`) with its keys
split over programs in runs sized by the cache (the default), in runs sized by the keys so far
(CMOE_ATTN_SPLIT=keys) and without a split (CMOE_ATTN_SPLIT=0), in one run: Mixtral-8x7B's
heads (32 query, 8 kv, 128 dims), bf16, batch 1 and 8, the slot (the keys so far) at 64, 320,
1024 and 2048 of a cache of 2112 slots and of 320; each the median of CUDA-graph replays (one
launch a call, the cache's layers rotating over 4 copies so little stays in L2).

    python3 benchmarks/attention_h200.py --out $OUT/attention.json        # ~20 s on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.expert_kernel_h200 import graph_us  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.executor.kernels_triton.attention import decode_attention, splits  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for B in (1, 8):
        for L, slots in ((320, (64, 319)), (2112, (64, 320, 1024, 2048))):
            qkv = torch.randn(B, (HQ + 2 * HKV) * D, generator=gen, device="cuda").to(torch.bfloat16)
            q, k, v = (t.reshape(B, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], -1))
            cos, sin = (torch.randn(B, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
            caches = [(torch.randn(B, HKV, L, D, generator=gen, device="cuda").to(torch.bfloat16),
                       torch.randn(B, HKV, L, D, generator=gen, device="cuda").to(torch.bfloat16)) for _ in range(4)]
            for at in slots:
                slot = torch.tensor([at], device="cuda")
                valid = torch.zeros(B, L, dtype=torch.bool, device="cuda")
                valid[:, :at + 1] = True
                row = {"B": B, "L": L, "keys": at + 1}
                for name, flag in (("split", "1"), ("keys", "keys"), ("one", "0")):
                    os.environ["CMOE_ATTN_SPLIT"] = flag
                    row[name + "_programs"] = splits(L)[0]          # a head's programs (the grid's third axis)
                    row[name + "_us"] = graph_us([lambda c=c: decode_attention(q, k, v, cos, sin, c[0], c[1], slot, valid,
                                                                               D ** -0.5) for c in caches])
                os.environ.pop("CMOE_ATTN_SPLIT")
                res["rows"].append(row)
                print(f"B={B} cache {L:5} keys {at + 1:5}: split ({row['split_programs']:2} programs) {row['split_us']:6.1f} us,"
                      f" by keys {row['keys_us']:6.1f} us, one program a head {row['one_us']:6.1f} us", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
