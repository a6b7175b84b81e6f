"""What bounds the int4 expert kernel at one row (issue 14): the bytes alone against the kernel.

At M = 1 the w13 kernel reads one Mixtral-8x7B expert's gate/up codes at ~2.0 TB/s and w2 at
~2.2, against ~4.3 TB/s for a device copy, and no split or tile of the committed sweep changed
that (BENCHMARKS.md). This probe times, in one run on the GPU:

- `stream`: a kernel that reads exactly the bytes the w13 (or w2) kernel reads, in the same
  order and with the same grid (BN rows of the tiled layout's k-blocks, their (scale, zero)
  words, from a pool slot), and only XORs them together, its k loop unrolled 1 or 4 times and
  given its own stages or not (`tl.range(num_stages=)`): a loop without a dot is pipelined only
  when it names its stages (Triton's AssignLatencies; compiled for sm_90 on a CPU, the stream's PTX
  has no cp.async without them and 36 with 2), while the kernel's loop, which has dots, is
  pipelined at the launch's stages. So the pipelined stream is the ceiling of the access pattern
  for each (BN, warps, split), and each row records its PTX's cp.async count;
- the w13 and w2 kernels at M = 1, 2, 4, 8, 16 over tiles, warps, dequantizing or not, and the
  unit loop's stages unset (the launch's) or named (4: `KernelConfig.stg13`, `stg2`);
- per M, the committed configuration and the fastest w13 + w2 pair that is right (one expert and
  a layer of 8 experts, top-2, against the fp32 reference), one expert and the layer timed.

If `stream` reaches the copy rate where the kernel does not, the kernel's work per byte (the
x tiles, the unpacking, the dots) bounds it; if `stream` itself stays far below it, the grid and
the access pattern do. Times are medians of CUDA-graph replays rotating over 4 slots (16 for a
layer), so nothing is served from L2.

    python3 benchmarks/kernel_probe_h200.py --out $OUT/probe        # ~2-3 min on the H200
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
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.expert_kernel_h200 import graph_us, hbm_tbps  # noqa: E402
from cmoe.executor.layout import slot_size  # noqa: E402
from cmoe.executor.moe_kernel import tiled_layout  # noqa: E402

H, FF, G = 4096, 14336, 128


@triton.jit
def _stream(pool_ptr, slot_bytes, table_ptr, out_ptr, w_off, sz_off, N, KB, UPS,
            BN: tl.constexpr, W13: tl.constexpr, UNR: tl.constexpr, STG: tl.constexpr = None):
    """The w13 (W13) or w2 kernel's reads for k-blocks [pid_k * UPS, ..) of BN rows, XORed; the
    k loop unrolled UNR times and, with STG, given its own stages (its loads pipelined)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot = tl.load(table_ptr)
    base = pool_ptr + slot.to(tl.int64) * slot_bytes
    wp = (base + w_off).to(tl.pointer_type(tl.int32))
    sp = (base + sz_off).to(tl.pointer_type(tl.int32))
    NR = 2 * N if W13 else N
    rn = pid_n * BN + tl.arange(0, BN)
    wrow = rn[:, None] * 16 + tl.arange(0, 16)[None, :]
    acc = tl.zeros((BN, 16), tl.int32)
    sacc = tl.zeros((BN,), tl.int32)
    lo = pid_k * UPS
    hi = tl.minimum(KB, lo + UPS)
    for kb in tl.range(lo, hi, num_stages=STG, loop_unroll_factor=UNR):
        blk = wp + kb * NR * 16
        acc ^= tl.load(blk + wrow)
        sacc ^= tl.load(sp + kb * NR + rn)
        if W13:
            acc ^= tl.load(blk + N * 16 + wrow)
            sacc ^= tl.load(sp + kb * NR + N + rn)
    r = tl.reduce(acc, 1, _xor) ^ sacc
    tl.store(out_ptr + pid_k * NR + rn, r)


@triton.jit
def _xor(a, b):
    return a ^ b


def _experts(lay, n: int, gen) -> torch.Tensor:
    """A pool of n slots holding random codes and (scale, zero) pairs in the tiled layout."""
    from cmoe.executor.moe_kernel import write_codes
    pool = torch.empty(n, slot_size(lay), dtype=torch.uint8, device="cuda")
    for e in range(n):
        for name, (o, i) in (("w13", (2 * FF, H)), ("w2", (H, FF))):
            codes = torch.randint(0, 16, (o, i), dtype=torch.int32, generator=gen, device="cuda")
            sz = torch.stack([torch.rand(i // G, o, generator=gen, device="cuda") * 0.004 + 0.001,
                              (torch.rand(i // G, o, generator=gen, device="cuda") - 0.5) * 0.01], -1)
            write_codes(pool[e], lay, name, codes, sz.to(torch.bfloat16))
    torch.cuda.synchronize()
    return pool


def _candidates(base):
    """Tiles x warps x the unit loop's own stages (0: unset, as committed) x dequantizing or not."""
    c13 = [replace(base, bn13=bn, warps13=w, stages13=3, deq=deq, unroll13=1, stg13=st)
           for bn, w in ((16, 1), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4)) for st in STAGES
           for deq in (False, True)]
    c2 = [replace(base, bn2=bn, warps2=w, split2=sp, stages2=3, deq2=deq, unroll2=1, stg2=st)
          for bn, w, sp in ((32, 1, 16), (64, 1, 16), (64, 2, 16), (32, 1, 8), (64, 2, 8), (128, 4, 16))
          for st in STAGES for deq in (False, True)]
    return c13, c2


STAGES = (0, 4)        # the kernel's loop is already pipelined at the launch's 3 stages (its PTX)


def _cp_async(k) -> int:
    """cp.async copies in a compiled kernel's PTX: whether Triton pipelined its loads."""
    try:
        ptx = k.asm["ptx"]
    except Exception:                                                    # noqa: BLE001
        return -1
    return ptx.count("cp.async.cg") + ptx.count("cp.async.ca")


def one_expert_inputs(ms, gen) -> dict:
    """M -> (x [M, H] bf16, routing weights of ones, a Workspace routed to one expert with a random
    h): what the w13 and w2 launches of one expert read, for each M."""
    from cmoe.executor.kernels_triton import Workspace
    from cmoe.executor.kernels_triton import moe as K
    data = {}
    for M in ms:
        x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
        ws = Workspace(M, 1, H, FF, 1, "cuda")
        K.launch_route(ws, torch.zeros(M, 1, dtype=torch.int32, device="cuda"))
        ws.h.normal_()
        data[M] = (x, torch.ones(M, 1, device="cuda"), ws)
    return data


def one_expert_launches(data: dict, pool, lay):
    """(w13(M, config, slot table, warmup=False), w2(...)): one expert's two launches over
    `one_expert_inputs`' buffers (with warmup, compile only)."""
    from cmoe.executor.kernels_triton import moe as K

    def w13(M, c, t, warmup=False):
        x, _, ws = data[M]
        return K.launch_w13(ws, x, t, pool, lay, 1, c, warmup=warmup)

    def w2(M, c, t, warmup=False):
        _, wts, ws = data[M]
        return K.launch_w2(ws, wts, t, pool, lay, 1, M, c, warmup=warmup)
    return w13, w2


def references(M: int, x, wts, pool, lay, tables, lay_tables):
    """The per-M cases the kernel benchmarks check and time: one expert (every row to slot
    tables[0]) and a layer of 8 experts at top-2 (seeded ids and weights, slots lay_tables[0]),
    with the layer's workspace and the fp32 reference of each. Returns (ids1, ref1, ids2, w2t,
    ws_layer, ref2)."""
    from cmoe.executor.kernels_triton import Workspace
    from cmoe.executor.moe_kernel import moe_reference
    ids1 = torch.zeros(M, 1, dtype=torch.int32, device="cuda")
    lg = torch.Generator().manual_seed(100 + M)
    ids2 = torch.stack([torch.randperm(8, generator=lg)[:2] for _ in range(M)]).int().cuda()
    w2t = torch.rand(M, 2, generator=lg).cuda()
    wsl = Workspace(M, 2, H, FF, 8, "cuda")
    ref1 = moe_reference(x, ids1, wts, tables[0], pool, lay, out_dtype=torch.float32)
    ref2 = moe_reference(x, ids2, w2t, lay_tables[0], pool, lay, out_dtype=torch.float32)
    return ids1, ref1, ids2, w2t, wsl, ref2


def _rel(a, b) -> float:
    return float(((a.double() - b.double()).norm() / b.double().norm()).item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", default="1,2,4,8,16")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from cmoe.executor.kernels_triton import moe_triton, pick_config

    t0 = time.time()
    res: dict = {"hbm_copy_tbps": hbm_tbps(), "device": torch.cuda.get_device_name()}
    lay = tiled_layout(f"w4g{G}", H, FF)
    sb = slot_size(lay)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = _experts(lay, 16, gen)
    print(f"HBM copy {res['hbm_copy_tbps']:.2f} TB/s; 16 experts in {time.time() - t0:.0f} s", flush=True)
    tables = [torch.tensor([r], dtype=torch.int32, device="cuda") for r in range(4)]
    lay_tables = [torch.arange(8, dtype=torch.int32, device="cuda") + 8 * i for i in range(2)]
    b13 = lay.part("w13").nbytes + lay.part("w13_sz").nbytes
    b2 = lay.part("w2").nbytes + lay.part("w2_sz").nbytes
    res["bytes"] = {"w13": b13, "w2": b2, "expert": lay.nbytes}
    sink = torch.empty(64 * 2 * FF, dtype=torch.int32, device="cuda")

    def stream_call(w13: bool, bn: int, warps: int, split: int, unr: int, stg, t, warmup=False):
        N, K_ = (FF, H) if w13 else (H, FF)
        kb = K_ // 128
        ups = triton.cdiv(kb, split)
        grid = (triton.cdiv(N, bn), triton.cdiv(kb, ups))
        a = (pool, sb, t, sink, lay.part("w13" if w13 else "w2").offset, lay.part("w13_sz" if w13 else "w2_sz").offset,
             N, kb, ups)
        kw = dict(BN=bn, W13=w13, UNR=unr, STG=stg, num_warps=warps, num_stages=3)
        if warmup:
            return _stream.warmup(*a, grid=grid, **kw)
        return _stream[grid](*a, **kw)

    streams = [(True, bn, w, 1, u, st) for bn, w in ((16, 1), (32, 1), (32, 2), (32, 4), (64, 4), (64, 8))
               for u in (1, 4) for st in (None, 2, 3, 4, 6)]
    streams += [(False, bn, w, sp, u, st) for bn, w, sp in ((16, 1, 4), (32, 1, 16), (64, 2, 16), (32, 1, 8))
                for u in (1, 4) for st in (None, 2, 3, 4, 6)]
    c13, c2 = _candidates(pick_config(1, triton_only=True))
    ms = [int(v) for v in args.ms.split(",")]
    data = one_expert_inputs(ms, gen)
    w13_call, w2_call = one_expert_launches(data, pool, lay)

    tc = time.time()
    with ThreadPoolExecutor(16) as ex, triton.AsyncCompileMode(ex, ignore_errors=True):
        for s in streams:
            stream_call(*s, tables[0], warmup=True)
        for c in c13:
            w13_call(ms[0], c, tables[0], warmup=True)
        for c in c2:
            w2_call(ms[0], c, tables[0], warmup=True)
    res["compile_s"] = time.time() - tc
    print(f"compiled {len(streams)} + {len(c13)} + {len(c2)} in {res['compile_s']:.0f} s", flush=True)
    rows = []
    for s in streams:
        us = graph_us([lambda t=t, s=s: stream_call(*s, t) for t in tables])
        rows.append({"what": "stream", "kernel": "w13" if s[0] else "w2", "bn": s[1], "warps": s[2], "split": s[3],
                     "unroll": s[4], "stg": s[5], "us": us, "tbps": (b13 if s[0] else b2) / us / 1e6,
                     "cp_async": _cp_async(stream_call(*s, tables[0]))})
    for M in ms:
        for kind, cands, call, nb in (("w13", c13, w13_call, b13), ("w2", c2, w2_call, b2)):
            for c in cands:
                try:
                    us = graph_us([lambda t=t, c=c: call(M, c, t) for t in tables])
                    k = call(M, c, tables[0])
                    regs = {"regs": k.n_regs, "spills": k.n_spills, "cp_async": _cp_async(k)}
                except Exception as err:                                  # noqa: BLE001
                    print("failed", kind, c, repr(err)[:160], flush=True)
                    continue
                rows.append({"what": "kernel", "kernel": kind, "M": M, **asdict(c), "us": us, "tbps": nb / us / 1e6,
                             **regs})
        print(f"M={M} timed ({time.time() - t0:.0f} s)", flush=True)
    res["rows"] = rows

    # per M: the committed config against the fastest w13 + w2 pair that is right on one expert
    # and on a layer (8 experts, top-2), both timed in the same run
    table = []
    for M in ms:
        x, wts, ws = data[M]
        ids1, ref1, ids2, w2t, wsl, ref2 = references(M, x, wts, pool, lay, tables, lay_tables)
        r13 = sorted((r for r in rows if r["what"] == "kernel" and r["kernel"] == "w13" and r["M"] == M and not r["spills"]),
                     key=lambda r: r["us"])
        r2 = sorted((r for r in rows if r["what"] == "kernel" and r["kernel"] == "w2" and r["M"] == M and not r["spills"]),
                    key=lambda r: r["us"])
        committed = pick_config(M)
        picks = [("committed", committed)]
        for a in r13[:3]:
            for b in r2[:3]:
                picks.append(("best", replace(committed, bn13=a["bn13"], warps13=a["warps13"], stages13=a["stages13"],
                                              deq=a["deq"], unroll13=a["unroll13"], stg13=a["stg13"], bn2=b["bn2"],
                                              warps2=b["warps2"], split2=b["split2"], stages2=b["stages2"],
                                              deq2=b["deq2"], unroll2=b["unroll2"], stg2=b["stg2"])))
        done_best = False
        for tag, cfg in picks:
            if tag == "best" and done_best:
                continue
            e1 = _rel(moe_triton(x, ids1, wts, tables[0], pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32), ref1)
            e2 = [_rel(moe_triton(x, ids2, w2t, lay_tables[0], pool, lay, workspace=wsl, config=cfg,
                                  out_dtype=torch.float32), ref2) for _ in range(2)]
            ok = max([e1] + e2) < (1e-2 if (cfg.deq or cfg.deq2) else 5e-3)
            rec = {"M": M, "tag": tag, "config": asdict(cfg), "expert_rel_err": e1, "layer_rel_err": e2, "ok": ok}
            if ok:
                rec["expert_us"] = graph_us([lambda t=t: moe_triton(x, ids1, wts, t, pool, lay, workspace=ws, config=cfg)
                                             for t in tables])
                rec["layer_us"] = graph_us([lambda t=t: moe_triton(x, ids2, w2t, t, pool, lay, workspace=wsl, config=cfg)
                                            for t in lay_tables])
                nexp = len(set(ids2.reshape(-1).tolist()))
                rec["expert_tbps"] = lay.nbytes / rec["expert_us"] / 1e6
                rec["layer_tbps"] = nexp * lay.nbytes / rec["layer_us"] / 1e6
                done_best = done_best or tag == "best"
            print(M, tag, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k != "config"},
                  cfg, flush=True)
            table.append(rec)
    res["table"] = table
    res["seconds"] = time.time() - t0
    tmp = out / "kernel_probe.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    tmp.rename(out / "kernel_probe.json")
    for kind in ("w13", "w2"):
        sel = sorted((r for r in rows if r["what"] == "stream" and r["kernel"] == kind), key=lambda r: r["us"])
        print(f"--- stream {kind}:", [(r["bn"], r["warps"], r["split"], r["unroll"], r["stg"], r["cp_async"],
                                       round(r["tbps"], 2)) for r in sel[:8]])
    for M in ms:
        for kind in ("w13", "w2"):
            sel = sorted((r for r in rows if r["what"] == "kernel" and r["kernel"] == kind and r.get("M") == M),
                         key=lambda r: r["us"])
            print(f"--- M={M} {kind}:", [(r[f"bn{kind[1:]}"], r[f"warps{kind[1:]}"], r.get("split2"),
                                          r[f"stg{kind[1:]}"], r["deq" if kind == "w13" else "deq2"],
                                          round(r["us"], 1), round(r["tbps"], 2), r["spills"], r["cp_async"])
                                         for r in sel[:5]])
            com = pick_config(M)
            mine = [r for r in sel if all(r[f] == getattr(com, f) for f in
                                          ((f"bn{kind[1:]}", f"warps{kind[1:]}", f"stg{kind[1:]}",
                                            "deq" if kind == "w13" else "deq2") + (("split2",) if kind == "w2" else ())))]
            if mine:
                print(f"    committed-like: {round(mine[0]['us'], 1)} us, cp.async {mine[0]['cp_async']}")
    print(f"took {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
