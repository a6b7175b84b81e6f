"""Expert kernels at the bandwidth limit, measured on one GPU in one run: the MoE-layer kernels as
CONFIGS choose them (`cmoe.executor.kernels_triton`, whose matmuls up to 16 rows are the CUDA C++
ones of `kernels_cuda` since the thirteenth session, up to 8 in the twelfth; the --split13-sweep
candidates are Triton's alone) against torch's `_weight_int4pack_mm` (tinygemm W4A16)
and bf16 `F.linear`, for one Mixtral-8x7B expert (H=4096, F=14336, g=128; w13, w2, and the
whole expert) and for a whole layer (8 experts, top-2 routing of M rows), M = 1..64.

Effective bandwidth = weight bytes the step must read (codes + scales for int4, 2 B a weight
for bf16; for the layer, the distinct experts its rows route to) / time, beside the HBM ceiling
(a device-to-device copy, bytes read + written). Times are medians of CUDA-graph replays, each
graph a run of calls rotating over 4 experts' weights (16 for the layer: two layers' worth) so
nothing sits in the 60 MB L2 between calls. gemlite (`benchmarks/gemlite_side.py`) runs beside
them where its wheel travels in .whl/ (`bash benchmarks/gemlite_wheel.sh`); else its column is nan.

    python benchmarks/expert_kernel_h200.py --out $OUT --split13-sweep   # issue 14: below, ~150 s
    python benchmarks/expert_kernel_h200.py --out $OUT            # sweep configs, then the table
    python benchmarks/expert_kernel_h200.py --out $OUT --no-sweep # CONFIGS as committed
    python benchmarks/expert_kernel_h200.py --out $OUT --no-sweep --diag   # + split-K w13 at M=8
    TRITON_INTERPRET=1 python benchmarks/expert_kernel_h200.py --out /tmp/e --split13-sweep --tiny  # smoke

--split13-sweep: for M = 1, 2, 4, 8, 16, the committed CONFIGS entry, then split-K of w13 (2, 4, 8
on it), then the same splits with other w13 tiles (64 rows on 2 warps, 128 on 4); each checked on
the layer (three runs: the errors, h bit-identical run to run, h against the unsplit kernel's) and
on one expert against the fp32 reference, and timed if right (layer, one expert, w13 alone). The
phases run over all M in turn and stop at --budget-s (seconds since the start; the committed
configs are always measured); then per M the fastest correct layer's table row (w13, w2, expert,
layer: this kernel, torch's int4 kernel, bf16) and the fastest correct one expert. --tiny: small
shapes on the CPU under Triton's interpreter (no inline PTX, no graphs, one call a time): only a
check that the path runs, its times mean nothing.

Writes $OUT/expert_kernel_h200.json; prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.kernels import dequantize, int4_mm, pack_cpu, pack_cuda  # noqa: E402
from cmoe.executor.layout import slot_size  # noqa: E402
from cmoe.executor.moe_kernel import moe_reference, tiled_layout, write_codes  # noqa: E402
from benchmarks import gemlite_side  # noqa: E402

H, FF, G = 4096, 14336, 128
EX = None
DEV = "cuda"                     # "cpu" with --tiny under TRITON_INTERPRET=1
MS = (1, 2, 4, 8, 16, 32, 64)
MS_SPLIT13 = (1, 2, 4, 8, 16)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def hbm_tbps() -> float:
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_()
    b = torch.empty_like(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(6):
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / best / 1e12


def graph_us(fns, reps: int = 24, replays: int = 7) -> float:
    """Median time of one call, from replays of a CUDA graph of `reps` calls rotating over fns
    (off CUDA: the wall time of one call of the first: a smoke test only)."""
    if DEV != "cuda":
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e6
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fns[r % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / reps)
    del g
    return statistics.median(ts)


def _regs(launch) -> dict:
    try:
        k = launch()
        return {"regs": k.n_regs, "spills": k.n_spills}
    except Exception:                                                      # noqa: BLE001
        return {}


class Experts:
    """n experts of random codes and scales, in the tiled pool, tinygemm's packing and bf16 (and
    gemlite's, with `gl`: `benchmarks.gemlite_side`)."""

    def __init__(self, n: int, gen: torch.Generator, gl: bool = False):
        self.lay = tiled_layout(f"w4g{G}", H, FF)
        self.pool = torch.empty(n, slot_size(self.lay), dtype=torch.uint8, device=DEV)
        self.tg, self.bf, self.gl = [], [], []
        gls = {}
        pack = pack_cuda if DEV == "cuda" else (lambda c: pack_cpu(c).to(DEV))
        for e in range(n):
            mats = {}
            for name, (o, i) in (("w13", (2 * FF, H)), ("w2", (H, FF))):
                codes = torch.randint(0, 16, (o, i), dtype=torch.int32, generator=gen, device=DEV)
                sz = torch.stack([torch.rand(i // G, o, generator=gen, device=DEV) * 0.004 + 0.001,
                                  (torch.rand(i // G, o, generator=gen, device=DEV) - 0.5) * 0.01], -1)
                sz = sz.to(torch.bfloat16)
                write_codes(self.pool[e], self.lay, name, codes, sz)
                mats[name] = (pack(codes), sz, dequantize(codes, sz, G).to(torch.bfloat16))
                if gl:
                    gl = self._gemlite(gls, name, codes, sz)
                del codes
            self.tg.append({k: v[:2] for k, v in mats.items()})
            self.bf.append({k: v[2] for k, v in mats.items()})
            if gl:
                self.gl.append(dict(gls))
            else:
                self.gl.clear()
        if DEV == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def _gemlite(gls: dict, name: str, codes, sz) -> bool:
        """gemlite's layer of these codes into `gls`; False where packing it fails (its error in
        `gemlite_side.STATE`: the run goes on without gemlite's column)."""
        try:
            gls[name] = gemlite_side.linear(codes, sz, G)
            return True
        except Exception as e:                                             # noqa: BLE001
            gemlite_side.failed("to pack", e)
            return False

    def int4_bytes(self, name: str) -> int:
        return self.lay.part(name).nbytes + self.lay.part(f"{name}_sz").nbytes


def torch_rows(r: dict, x, hM, ex, ids2, w2t, nexp: int, slot_bytes: int, sizes: tuple) -> None:
    """Into `r`: torch's int4 kernel and bf16 on the same step (w13, w2, one expert, the layer
    whose top-2 routing is `ids2`/`w2t`), then every implementation's effective TB/s from the
    bytes it must read (`sizes`: int4 w13, w2; bf16 w13, w2)."""
    b13, b2, bf13, bf2 = sizes
    r["w13_tg"] = graph_us([lambda e=e: tg_mm(x, ex.tg[e]["w13"]) for e in range(4)])
    r["w2_tg"] = graph_us([lambda e=e: tg_mm(hM, ex.tg[e]["w2"]) for e in range(4)])
    r["expert_tg"] = graph_us([lambda e=e: tg_expert(x, ex.tg[e]) for e in range(4)])
    r["w13_bf"] = graph_us([lambda e=e: F.linear(x, ex.bf[e]["w13"]) for e in range(4)])
    r["w2_bf"] = graph_us([lambda e=e: F.linear(hM, ex.bf[e]["w2"]) for e in range(4)])
    r["expert_bf"] = graph_us([lambda e=e: bf_expert(x, ex.bf[e]) for e in range(4)])
    rows_of = {}
    for e in sorted(set(ids2.reshape(-1).tolist())):
        rr, cc = (ids2 == e).nonzero(as_tuple=True)
        rows_of[e] = (rr.to(DEV), w2t[rr, cc].to(DEV).to(torch.bfloat16))
    for name, fn, store in (("tg", tg_expert, ex.tg), ("bf", bf_expert, ex.bf)):
        r[f"layer_{name}"] = graph_us([lambda s=s: layer_torch(x, rows_of, s, fn) for s in _layer_sets(store)])
    impls = ("mine", "tg", "bf") + (("gl",) if ex.gl and _gl_rows(r, x, hM, ex, rows_of) else ())
    for k in ("w13", "w2", "expert", "layer"):
        nb_i4 = {"w13": b13, "w2": b2, "expert": slot_bytes, "layer": nexp * slot_bytes}[k]
        nb_bf = {"w13": bf13, "w2": bf2, "expert": bf13 + bf2, "layer": nexp * (bf13 + bf2)}[k]
        for impl in impls:
            r[f"{k}_{impl}_tbps"] = (nb_bf if impl == "bf" else nb_i4) / r[f"{k}_{impl}"] / 1e6


def _layer_sets(store: list) -> list[dict]:
    """Two layers' experts (0-7 and 8-15), so that consecutive calls read different bytes."""
    return [{e: store[e + 8 * i] for e in range(8)} for i in range(2)]


def _gl_rows(r: dict, x, hM, ex, rows_of: dict) -> bool:
    """gemlite's w13, w2, one expert and the layer into `r` (`*_gl`, us); False, its error recorded
    and its experts dropped for the rest of the run, where a call fails (an autotune or a shape it
    lacks, or a capture it does not survive)."""
    spent, longest = gemlite_side.STATE.get("spent_s", 0.0), gemlite_side.STATE.get("longest_s", 0.0)
    if spent + longest > gemlite_side.STATE.get("budget_s", float("inf")):   # an autotune must not starve the rest
        r["gl_error"] = f"budget: gemlite took {spent:.0f} s before this M, its longest row {longest:.0f} s"
        print(f"M={r['M']}: gemlite dropped, {r['gl_error']}", flush=True)
        ex.gl.clear()
        return False
    t0 = time.time()
    try:
        r["w13_gl"] = graph_us([lambda e=e: ex.gl[e]["w13"](x) for e in range(4)])
        r["w2_gl"] = graph_us([lambda e=e: ex.gl[e]["w2"](hM) for e in range(4)])
        r["expert_gl"] = graph_us([lambda e=e: gemlite_side.expert(x, ex.gl[e]) for e in range(4)])
        r["layer_gl"] = graph_us([lambda s=s: layer_torch(x, rows_of, s, gemlite_side.expert)
                                  for s in _layer_sets(ex.gl)])
        took = time.time() - t0
        gemlite_side.STATE.update(spent_s=spent + took, longest_s=max(longest, took))
        return True
    except Exception as e:                                                 # noqa: BLE001
        for k in ("w13_gl", "w2_gl", "expert_gl", "layer_gl"):
            r.pop(k, None)
        r["gl_error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"M={r['M']}: gemlite failed, dropped: {r['gl_error']}", flush=True)
        ex.gl.clear()
        return False


def tg_mm(x, w):
    return int4_mm(x, w[0], G, w[1])           # torch's _weight_int4pack_mm (its CPU twin off CUDA)


def tg_expert(x, ex):
    a, b = tg_mm(x, ex["w13"]).chunk(2, dim=-1)
    return tg_mm(F.silu(a) * b, ex["w2"])


def bf_expert(x, ex):
    a, b = F.linear(x, ex["w13"]).chunk(2, dim=-1)
    return F.linear(F.silu(a) * b, ex["w2"])


def layer_torch(x, rows_of, experts, expert_fn):
    """The layer the executor's way: per routed expert, its rows, the expert, index_add."""
    out = torch.zeros_like(x)
    for e, (r, w) in rows_of.items():
        y = expert_fn(x.index_select(0, r), experts[e])
        out.index_add_(0, r, y * w[:, None])
    return out


def _rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer_ref(x, ids, wts, deq32):
    """The layer from experts 0-7's bytes (slots 0-7), fp32 math, h rounded to bf16 as the kernels do."""
    from cmoe.executor.moe_kernel import dequantized
    out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=DEV)
    for e in sorted(set(ids.reshape(-1).tolist())):
        if e not in deq32:
            deq32[e] = dequantized(EX.pool[e], EX.lay)
        w13, w2 = deq32[e]
        rr, cc = (ids == e).nonzero(as_tuple=True)
        r = rr.to(DEV)
        a, b = (x.float().index_select(0, r) @ w13.T).chunk(2, dim=-1)
        h = (F.silu(a) * b).to(torch.bfloat16).float()
        out.index_add_(0, r, (h @ w2.T) * wts[rr, cc].to(DEV)[:, None])
    return out


def _diag(pool, lay, gen) -> dict:
    """The layer at M=8 (8 experts, top-2) with w13 split 2 and 4 against w13 unsplit, against the
    fp32 reference, three runs each: the errors, h run to run, h against the unsplit h."""
    from cmoe.executor.kernels_triton import KernelConfig, Workspace
    from cmoe.executor.kernels_triton import moe as K
    M = 8
    lg = torch.Generator().manual_seed(100 + M)
    ids = torch.stack([torch.randperm(8, generator=lg)[:2] for _ in range(M)]).int()
    w = torch.rand(M, 2, generator=lg)
    w = w / w.sum(-1, keepdim=True)
    x = torch.randn(M, H, generator=gen, device="cuda").to(torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32, device="cuda")
    ref = _layer_ref(x, ids, w, {})
    a = KernelConfig(16, 64, 2, 3, 128, 16, 4, 3, deq=False, deq2=True, split13=2)
    out = {}
    for name, cfg in (("split13=2", a), ("split13=1", replace(a, split13=1)),
                      ("split13=2,w2 64/1", replace(a, bn2=64, warps2=1, deq2=False)),
                      ("split13=2,deq", replace(a, deq=True)), ("split13=4", replace(a, split13=4))):
        ws = Workspace(M, 2, H, FF, 8, "cuda")
        errs, hs = [], []
        for _ in range(3):
            y = K.moe_triton(x, ids.cuda(), w.cuda(), table, pool, lay, workspace=ws, config=cfg,
                             out_dtype=torch.float32)
            errs.append(_rel_err(y, ref))
            hs.append(ws.h.clone())
        out[name] = {"layer_rel_err": errs, "h_run_to_run": max(_rel_err(h, hs[0]) for h in hs[1:]),
                     "h_bit_identical": all(torch.equal(h, hs[0]) for h in hs[1:])}
        out[name]["h"] = hs[0]
    h1 = out["split13=1"]["h"]
    for name in out:
        out[name]["h_vs_unsplit"] = _rel_err(out[name].pop("h"), h1)
    print("diag", json.dumps(out), flush=True)
    return out


def _fallbacks(M: int, committed):
    """Triton configurations tried after the sweep's best and the committed CONFIGS entry: `committed`
    (the entry with the CUDA kernel off), the same without split-K of w13, and the plain ones
    measured before split-K existed."""
    from cmoe.executor.kernels_triton import KernelConfig
    out = [committed, replace(committed, split13=1)]
    if M <= 16:
        out += [KernelConfig(16, 32, 2, 3, 64, 16, 1, 3, deq=False, deq2=False),
                KernelConfig(16, 128, 4, 3, 128, 16, 4, 3, deq=True, deq2=True)]
    elif M <= 32:
        out += [KernelConfig(32, 64, 4, 4, 64, 8, 4, 3, deq=False, deq2=True)]
    else:
        out += [KernelConfig(64, 64, 4, 3, 64, 4, 4, 3, deq=False, deq2=True)]
    return out


def candidates(bm: int):
    """(w13 configs, w2 configs) tried for a row block bm (compiled in parallel, a few seconds)."""
    from cmoe.executor.kernels_triton import KernelConfig
    base = KernelConfig(bm, 32, 2, 3, 64, 16, 1, 3)
    if bm <= 16:
        s13, st13, sp13 = ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4)), (3, 4), (1,)
        s2, st2, sp2 = ((32, 1), (32, 2), (64, 1), (64, 2), (128, 4)), (3,), (8, 16, 32)
    else:
        s13, st13, sp13 = ((32, 1), (32, 2), (64, 2), (64, 4)), (3,), (1,)
        s2, st2, sp2 = ((32, 1), (64, 2), (64, 4), (128, 4)), (3,), (4, 8, 16)
    c13, c2 = [], []
    for bn, w in s13:
        for st in st13:
            for deq in (True, False):
                for sp in sp13:
                    c13.append(replace(base, bn13=bn, warps13=w, stages13=st, deq=deq, split13=sp))
    for bn, w in s2:
        for st in st2:
            for deq in (True, False):
                for sp in sp2:
                    c2.append(replace(base, bn2=bn, split2=sp, warps2=w, stages2=st, deq2=deq))
    return c13, c2


def print_table(res: dict, rows: list) -> None:
    hbm = res.get("hbm_copy_tbps", float("nan"))
    print(f"\n{res['gpu']}, torch {res['torch']}, triton {res['triton']}, {res['date']}; HBM copy {hbm:.2f} TB/s")
    print("effective TB/s (weight bytes / time); mine = CONFIGS as committed (CUDA C++ or Triton),"
          f" tg = torch _weight_int4pack_mm, bf = bf16 F.linear, gl = {res.get('gemlite')} (nan: not run)")
    nan, impls = float("nan"), ("mine", "tg", "bf", "gl")
    print(f"{'M':>3} | " + " | ".join(f"{k:^27}" for k in ("w13", "w2", "expert", "layer (8 exp, top-2)")))
    print(f"{'':>3} | " + " | ".join(" ".join(f"{i:>6}" for i in impls) for _ in range(4)))
    for r in rows:
        print(f"{r['M']:>3} | " + " | ".join(" ".join(f"{r.get(f'{k}_{i}_tbps', nan):6.2f}" for i in impls)
                                            for k in ("w13", "w2", "expert", "layer")))
    print("\nmicroseconds:")
    for r in rows:
        print(f"{r['M']:>3} | " + " | ".join(" ".join(f"{r.get(f'{k}_{i}', nan):6.1f}" for i in impls)
                                            for k in ("w13", "w2", "expert", "layer"))
              + f"  (layer reads {r['layer_experts']} experts, fastest Triton-only layer"
                f" {r.get('layer_triton_best', nan):.1f}; rel err layer {r['layer_rel_err']:.1e},"
                f" expert {r['expert_rel_err']:.1e})")
    print("\nconfigs:")
    for r in rows:
        print(r["M"], r["config"])


def _header() -> dict:
    import triton
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__,
            "shape": {"H": H, "F": FF, "g": G}, "gemlite": gemlite_side.STATE["status"]}


def _commit() -> str | None:
    """COMMIT as gpu_session.sh is called (the device's copy of the tree may carry an older .git:
    thirty-ninth session, where this recorded the session's first commit), else git's HEAD."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        return None


def split13_variants(committed, tiny: bool = False) -> list:
    """(phase, config) per M: 0 the committed config; 1 split-K of w13 2, 4, 8 on it; 2 the same
    splits with other w13 tiles, 64 rows on 2 warps and 128 on 4 (32 rows a warp: mma.sync)."""
    if tiny:
        return [(0, replace(committed, asm=False)), (1, replace(committed, asm=False, split13=2))]
    out = [(0, committed)] + [(1, replace(committed, split13=s)) for s in (2, 4, 8)]
    for bn, w in ((64, 2), (128, 4)):
        out += [(2, replace(committed, bn13=bn, warps13=w, split13=s)) for s in (4, 8, 2)]
    seen, uniq = set(), []
    for ph, c in out:
        if c not in seen:
            seen.add(c)
            uniq.append((ph, c))
    return uniq


def split13_sweep(args, out: Path) -> None:
    """--split13-sweep (see the module docstring)."""
    global H, FF, G, DEV, EX
    t0 = time.time()
    if args.tiny:
        H, FF, G = 256, 128, 128
        DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("--split13-sweep needs CUDA (or --tiny under TRITON_INTERPRET=1)")
    import triton

    from cmoe.executor.kernels_triton import KernelConfig, Workspace, moe_triton, pick_config
    from cmoe.executor.kernels_triton import moe as K
    ms = [int(v) for v in args.ms.split(",")] if args.ms else list((1, 3) if args.tiny else MS_SPLIT13)
    nrun = 2 if args.tiny else 3
    res = _header()
    res["mode"] = "split13-sweep" + (" tiny" if args.tiny else "")
    res["budget_s"] = args.budget_s
    if not args.tiny:
        res["commit"] = _commit()
    if DEV == "cuda":
        res["hbm_copy_tbps"] = hbm_tbps()
        print(f"HBM copy {res['hbm_copy_tbps']:.2f} TB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ex = EX = Experts(16, gen)
    lay, pool = ex.lay, ex.pool
    b13, b2 = ex.int4_bytes("w13"), ex.int4_bytes("w2")
    bf13, bf2 = 2 * 2 * FF * H, 2 * H * FF
    res["bytes"] = {"w13_int4": b13, "w2_int4": b2, "expert_int4": lay.nbytes, "w13_bf16": bf13, "w2_bf16": bf2}
    res["configs_committed"] = {m: asdict(c) for m, c in K.CONFIGS.items()}
    print(f"built 16 experts at {time.time() - t0:.0f} s", flush=True)
    i32 = dict(dtype=torch.int32, device=DEV)
    tables = [torch.tensor([r], **i32) for r in range(4)]                  # one expert: 4 slots in turn
    lay_tables = [torch.arange(8, **i32) + 8 * i for i in range(2)]        # the layer: two layers' worth
    deq32: dict = {}
    data, cands = {}, {}
    for M in ms:
        x = torch.randn(M, H, generator=gen, device=DEV).to(torch.bfloat16)
        lg = torch.Generator().manual_seed(100 + M)
        ids2 = torch.stack([torch.randperm(8, generator=lg)[:2] for _ in range(M)]).int()
        w2t = torch.rand(M, 2, generator=lg)
        w2t = w2t / w2t.sum(-1, keepdim=True)
        d = {"x": x, "ids2": ids2, "w2t": w2t, "ids2d": ids2.to(DEV), "w2d": w2t.to(DEV),
             "ids": torch.zeros(M, 1, **i32), "wts": torch.ones(M, 1, device=DEV),
             "ws": Workspace(M, 1, H, FF, 1, DEV), "wsl": Workspace(M, 2, H, FF, 8, DEV),
             "hM": torch.randn(M, FF, generator=gen, device=DEV).to(torch.bfloat16),
             "nexp": len(set(ids2.reshape(-1).tolist()))}
        d["ref_layer"] = _layer_ref(x, ids2, w2t, deq32)
        d["ref_one"] = _layer_ref(x, torch.zeros(M, 1, dtype=torch.int32), torch.ones(M, 1), deq32)
        data[M] = d
        cands[M] = split13_variants(pick_config(M, triton_only=True), args.tiny)
    print(f"references at {time.time() - t0:.0f} s", flush=True)

    if DEV == "cuda":                      # compile every candidate at once (16 threads)
        tc = time.time()
        with ThreadPoolExecutor(16) as pex, triton.AsyncCompileMode(pex, ignore_errors=True):
            for M in ms:
                d = data[M]
                for _, c in cands[M] + [(0, replace(pick_config(M, triton_only=True), split13=1))]:
                    K.launch_w13(d["wsl"], d["x"], lay_tables[0], pool, lay, 2, c, warmup=True)
                    K.launch_w2(d["wsl"], d["w2d"], lay_tables[0], pool, lay, 2, M, c, warmup=True)
        print(f"compiled {sum(len(v) for v in cands.values())} candidates in {time.time() - tc:.0f} s", flush=True)

    def layer_call(d, c, t, out_dtype=None):
        return moe_triton(d["x"], d["ids2d"], d["w2d"], t, pool, lay, workspace=d["wsl"], config=c,
                          out_dtype=out_dtype)

    def expert_call(d, c, t, out_dtype=None):
        return moe_triton(d["x"], d["ids"], d["wts"], t, pool, lay, workspace=d["ws"], config=c,
                          out_dtype=out_dtype)

    for M in ms:                           # the unsplit h of the committed tiles, for comparison
        d = data[M]
        layer_call(d, replace(cands[M][0][1], split13=1), lay_tables[0], torch.float32)
        d["h1"] = d["wsl"].h.clone()

    def evaluate(M: int, ph: int, c) -> dict:
        d = data[M]
        rec = {"M": M, "phase": ph, "config": asdict(c)}
        try:
            errs, hs = [], []
            for _ in range(nrun):          # a race or a stale read shows as a changing h
                errs.append(_rel_err(layer_call(d, c, lay_tables[0], torch.float32), d["ref_layer"]))
                hs.append(d["wsl"].h.clone())
            e1 = _rel_err(expert_call(d, c, tables[0], torch.float32), d["ref_one"])
            rec.update(layer_rel_err=errs, expert_rel_err=e1,
                       h_bit_identical=all(torch.equal(h, hs[0]) for h in hs[1:]),
                       h_vs_unsplit=_rel_err(hs[0].float(), d["h1"].float()))
            ok = max(errs + [e1]) < 1e-2 and rec["h_vs_unsplit"] < 1e-2       # NaN fails too
            rec["correct"] = bool(ok)
            if ok:
                rec["layer_us"] = graph_us([lambda t=t: layer_call(d, c, t) for t in lay_tables])
                rec["expert_us"] = graph_us([lambda t=t: expert_call(d, c, t) for t in tables])
                rec["w13_us"] = graph_us([lambda t=t: K.launch_w13(d["ws"], d["x"], t, pool, lay, 1, c)
                                          for t in tables])
                rec["expert_tbps"] = lay.nbytes / rec["expert_us"] / 1e6
                rec["w13_tbps"] = b13 / rec["w13_us"] / 1e6
                rec["layer_tbps"] = d["nexp"] * lay.nbytes / rec["layer_us"] / 1e6
        except Exception as err:                                           # noqa: BLE001 (a config that fails)
            rec["correct"] = False
            rec["error"] = repr(err)[:300]
        if "layer_us" in rec:
            msg = (f"layer {rec['layer_us']:7.1f} us {rec['layer_tbps']:.2f} TB/s | expert {rec['expert_us']:6.1f} us"
                   f" {rec['expert_tbps']:.2f} TB/s | w13 {rec['w13_us']:6.1f} us {rec['w13_tbps']:.2f} TB/s")
        else:
            msg = f"WRONG or failed: {rec.get('error', '')} errors {rec.get('layer_rel_err')} {rec.get('expert_rel_err')}"
        print(f"M={M} [{time.time() - t0:5.0f} s] split13={c.split13} bn13={c.bn13} warps13={c.warps13}"
              f" deq={c.deq}: {msg} (h identical {rec.get('h_bit_identical')},"
              f" vs unsplit {rec.get('h_vs_unsplit', float('nan')):.1e})", flush=True)
        return rec

    tried: dict[int, list] = {M: [] for M in ms}
    skipped = []
    for phase in (0, 1, 2):                # every M gets a phase before any M gets the next one
        for M in ms:
            for ph, c in cands[M]:
                if ph != phase:
                    continue
                if phase and time.time() - t0 > args.budget_s:
                    skipped.append({"M": M, **asdict(c)})
                    continue
                tried[M].append(evaluate(M, ph, c))
    if skipped:
        print(f"budget {args.budget_s} s reached: {len(skipped)} candidates not tried", flush=True)
    res["skipped"] = skipped
    res["sweep"] = tried

    rows = []
    for M in ms:
        d = data[M]
        x, hM = d["x"], d["hM"]
        ok = [t for t in tried[M] if "layer_us" in t]
        if not ok:
            print(f"M={M}: no correct candidate", flush=True)
            continue
        pick = min(ok, key=lambda t: t["layer_us"])
        fast1 = min(ok, key=lambda t: t["expert_us"])
        cfg = KernelConfig(**pick["config"])
        r = {"M": M, "config": asdict(cfg), "layer_rel_err": max(pick["layer_rel_err"]),
             "expert_rel_err": pick["expert_rel_err"], "layer_experts": d["nexp"],
             "fastest_expert": {k: fast1[k] for k in ("config", "expert_us", "expert_tbps", "w13_us", "w13_tbps")}}
        r["w13_mine"], r["expert_mine"], r["layer_mine"] = pick["w13_us"], pick["expert_us"], pick["layer_us"]
        r["w2_mine"] = graph_us([lambda t=t: K.launch_w2(d["ws"], d["wts"], t, pool, lay, 1, M, cfg) for t in tables])
        torch_rows(r, x, hM, ex, d["ids2"], d["w2t"], d["nexp"], lay.nbytes, (b13, b2, bf13, bf2))
        rows.append(r)
        res["table"] = rows
        (out / "expert_kernel_h200.json").write_text(json.dumps(res, indent=1, default=str))
    res["table"] = rows
    res["wall_s"] = time.time() - t0
    (out / "expert_kernel_h200.json").write_text(json.dumps(res, indent=1, default=str))

    print("\nsplit13 sweep, per M (correct candidates; us and effective TB/s):")
    for M in ms:
        for t in tried[M]:
            c = t["config"]
            tag = (f"  M={M:>2} split13={c['split13']} bn13={c['bn13']:>3} warps13={c['warps13']} deq={c['deq']!s:5}")
            if "layer_us" in t:
                print(f"{tag} layer {t['layer_us']:7.1f} ({t['layer_tbps']:.2f}) expert {t['expert_us']:6.1f}"
                      f" ({t['expert_tbps']:.2f}) w13 {t['w13_us']:6.1f} ({t['w13_tbps']:.2f})")
            else:
                print(f"{tag} WRONG/failed {t.get('layer_rel_err')} {t.get('expert_rel_err')} {t.get('error', '')}")
    print_table(res, rows)
    hbm = res.get("hbm_copy_tbps", float("nan"))
    print("\nfastest correct one expert per M (goal at M = 1: >= 2.8 TB/s):")
    for r in rows:
        f1 = r["fastest_expert"]
        print(f"  M={r['M']:>2}: {f1['expert_us']:.1f} us, {f1['expert_tbps']:.2f} TB/s"
              f" ({100 * f1['expert_tbps'] / hbm:.0f}% of the HBM copy), w13 {f1['w13_tbps']:.2f} TB/s, {f1['config']}")
    print(f"\nwall {res['wall_s']:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--ms", default=None, help=f"batch rows, comma-separated (default {','.join(map(str, MS))};"
                                               f" with --split13-sweep {','.join(map(str, MS_SPLIT13))})")
    ap.add_argument("--diag", action="store_true", help="the layer at M=8 with split-K w13 against unsplit")
    ap.add_argument("--split13-sweep", action="store_true",
                    help="committed CONFIGS and split-K w13 variants per M, checked, then the table (~150 s)")
    ap.add_argument("--budget-s", type=float, default=110.0,
                    help="--split13-sweep: no new variant is tried after this many seconds from the start")
    ap.add_argument("--tiny", action="store_true",
                    help="--split13-sweep on small shapes (CPU under TRITON_INTERPRET=1): a smoke test")
    ap.add_argument("--gemlite-config", default=None,
                    help="gemlite's configurations: a shipped file's name (h100) or autotune; default as it loads them")
    ap.add_argument("--no-gemlite", action="store_true", help="leave gemlite's column out")
    ap.add_argument("--gemlite-budget-s", type=float, default=110.0,
                    help="no gemlite row is started where its rows so far and its longest one would pass this (an "
                    "autotune per new shape; forty-sixth session, an H100 with h100.json: M 1, 2, 4 took 34 s, the "
                    "longest 26, so 60 s stopped it before M = 8)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.split13_sweep or args.tiny:
        split13_sweep(args, out)
        return
    ms = [int(v) for v in (args.ms or ",".join(map(str, MS))).split(",")]
    import triton

    from cmoe.executor.kernels_triton import CONFIGS, Workspace, moe_triton, pick_config
    from cmoe.executor.kernels_triton import moe as K

    if not args.no_gemlite:
        print(gemlite_side.load(args.gemlite_config), flush=True)
        gemlite_side.STATE["budget_s"] = args.gemlite_budget_s
    res: dict = _header()
    res["commit"] = _commit()
    t0 = time.time()
    res["hbm_copy_tbps"] = hbm_tbps()
    print(f"HBM copy {res['hbm_copy_tbps']:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    global EX
    ex = EX = Experts(16, gen, gl=gemlite_side.STATE["module"] is not None)
    lay, pool = ex.lay, ex.pool
    print(f"built 16 experts in {time.time() - t0:.0f} s", flush=True)
    b13, b2 = ex.int4_bytes("w13"), ex.int4_bytes("w2")
    bf13, bf2 = 2 * 2 * FF * H, 2 * H * FF
    res["bytes"] = {"w13_int4": b13, "w2_int4": b2, "expert_int4": lay.nbytes, "w13_bf16": bf13, "w2_bf16": bf2}
    tables = [torch.tensor([r], dtype=torch.int32, device="cuda") for r in range(4)]

    # correctness at Mixtral shapes first (one expert and a layer), against the torch reference
    x8 = torch.randn(8, H, generator=gen, device="cuda").to(torch.bfloat16)
    ids8 = torch.stack([torch.randperm(8, generator=gen, device="cuda")[:2] for _ in range(8)]).int()
    w8 = torch.rand(8, 2, generator=gen, device="cuda")
    t8 = torch.arange(8, dtype=torch.int32, device="cuda")
    got = moe_triton(x8, ids8, w8, t8, pool, lay, out_dtype=torch.float32).clone()
    ref = moe_reference(x8, ids8, w8, t8, pool, lay, out_dtype=torch.float32)
    res["check_rel_err_layer_m8"] = ((got - ref).norm() / ref.norm()).item()
    y_tg = tg_expert(x8, ex.tg[3]).float()
    y_bf = bf_expert(x8, ex.bf[3]).float()
    y_me = moe_triton(x8, torch.zeros(8, 1, dtype=torch.int32, device="cuda"), torch.ones(8, 1, device="cuda"),
                      tables[3], pool, lay, out_dtype=torch.float32)
    res["check_rel_err_expert_vs_tinygemm"] = ((y_me - y_tg).norm() / y_tg.norm()).item()
    res["check_rel_err_tinygemm_vs_bf16"] = ((y_tg - y_bf).norm() / y_bf.norm()).item()
    if ex.gl:
        t_gl = time.time()
        try:                                     # gemlite's first call (and, autotuning, its first tune)
            y_gl = gemlite_side.expert(x8, ex.gl[3]).float()
            gemlite_side.STATE["spent_s"] = time.time() - t_gl
            res["check_rel_err_gemlite_vs_bf16"] = ((y_gl - y_bf).norm() / y_bf.norm()).item()
        except Exception as e:                                             # noqa: BLE001
            gemlite_side.failed("its first call", e)
            ex.gl.clear()
    res["gemlite"] = gemlite_side.STATE["status"]
    print({k: v for k, v in res.items() if k.startswith("check")}, flush=True)

    def single(M):
        x = torch.randn(M, H, generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.zeros(M, 1, dtype=torch.int32, device="cuda")
        wts = torch.ones(M, 1, device="cuda")
        ws = Workspace(M, 1, H, FF, 1, "cuda")
        K.launch_route(ws, ids)
        ws.h.copy_(torch.randn(M, FF, generator=gen, device="cuda").to(torch.bfloat16))
        return x, ids, wts, ws

    # --- sweep: per row block, compile every candidate in parallel, time w13 and w2 alone
    best: dict[int, dict] = {}
    if not args.no_sweep:
        sweep = []
        for bm, m_list in ((16, [m for m in ms if m <= 16]), (32, [m for m in ms if 16 < m <= 32]),
                           (64, [m for m in ms if 32 < m <= 64])):
            if not m_list:
                continue
            c13, c2 = candidates(bm)
            data = {M: single(M) for M in m_list}
            tc = time.time()
            with ThreadPoolExecutor(16) as pool_ex, triton.AsyncCompileMode(pool_ex, ignore_errors=True):
                for M, (x, ids, wts, ws) in data.items():
                    for c in c13:
                        K.launch_w13(ws, x, tables[0], pool, lay, 1, c, warmup=True)
                    for c in c2:
                        K.launch_w2(ws, wts, tables[0], pool, lay, 1, M, c, warmup=True)
                    break              # one M compiles all: the row count is no specialization
            print(f"bm={bm}: compiled {len(c13)}+{len(c2)} configs in {time.time() - tc:.0f} s", flush=True)
            for M, (x, ids, wts, ws) in data.items():
                r13, r2 = [], []
                for c in c13:
                    try:
                        us = graph_us([lambda t=t, c=c: K.launch_w13(ws, x, t, pool, lay, 1, c) for t in tables])
                    except Exception as err:                       # noqa: BLE001 (a config that fails)
                        us = float("nan")
                        print("w13 failed", c, repr(err)[:200], flush=True)
                    r13.append((us, c))
                    sweep.append({"M": M, "kernel": "w13", "us": us, "tbps": b13 / us / 1e6, **asdict(c),
                                  **_regs(lambda c=c: K.launch_w13(ws, x, tables[0], pool, lay, 1, c))})
                for c in c2:
                    try:
                        us = graph_us([lambda t=t, c=c: K.launch_w2(ws, wts, t, pool, lay, 1, M, c) for t in tables])
                    except Exception as err:                       # noqa: BLE001
                        us = float("nan")
                        print("w2 failed", c, repr(err)[:200], flush=True)
                    r2.append((us, c))
                    sweep.append({"M": M, "kernel": "w2", "us": us, "tbps": b2 / us / 1e6, **asdict(c),
                                  **_regs(lambda c=c: K.launch_w2(ws, wts, tables[0], pool, lay, 1, M, c))})
                ok13 = [r for r in r13 if r[0] == r[0]]
                ok2 = [r for r in r2 if r[0] == r[0]]
                u13, c13b = min(ok13, key=lambda r: r[0])
                u2, c2b = min(ok2, key=lambda r: r[0])
                cfg = replace(c13b, bn2=c2b.bn2, split2=c2b.split2, warps2=c2b.warps2, stages2=c2b.stages2,
                              deq2=c2b.deq2, asm=c13b.asm and c2b.asm)
                asm_same = c13b.asm == c2b.asm
                best[M] = {"config": cfg, "w13_us": u13, "w2_us": u2, "asm_agree": asm_same}
                if M == m_list[0] and bm == 16:                 # the compiled code, to read here
                    for nm, fn in (("w13", lambda: K.launch_w13(ws, x, tables[0], pool, lay, 1, c13b)),
                                   ("w2", lambda: K.launch_w2(ws, wts, tables[0], pool, lay, 1, M, c2b))):
                        (out / f"best_{nm}_bm{bm}.ptx").write_text(fn().asm["ptx"])
                print(f"M={M}: best w13 {u13:.1f} us ({b13 / u13 / 1e6:.2f} TB/s) {c13b}\n"
                      f"      best w2  {u2:.1f} us ({b2 / u2 / 1e6:.2f} TB/s) {c2b}", flush=True)
                (out / "sweep.json").write_text(json.dumps(sweep, indent=1))
        res["sweep_best"] = {M: {**asdict(b["config"]), "w13_us": b["w13_us"], "w2_us": b["w2_us"]}
                             for M, b in best.items()}
        print(f"sweep done at {time.time() - t0:.0f} s", flush=True)
    res["configs_committed"] = {m: asdict(c) for m, c in CONFIGS.items()}
    if args.diag:
        res["diag"] = _diag(pool, lay, gen)

    # --- the table: per M, candidate configurations (the sweep's best first, then the committed
    # entry, then the Triton-only ones); each is checked on the single expert and on its layer
    # against fp32 dequantized weights; the row is the committed entry's when it is right (what the
    # executor runs), else the fastest right layer's, and the fastest Triton-only layer stands beside it
    deq32 = {}
    rows = []
    for M in ms:
        cands = []
        if M in best:
            cands.append(best[M]["config"])
        committed = pick_config(M)
        cands += [c for c in [committed] + _fallbacks(M, pick_config(M, triton_only=True)) if c not in cands]
        x, ids, wts, ws = single(M)
        hM = torch.randn(M, FF, generator=gen, device="cuda").to(torch.bfloat16)
        lg = torch.Generator().manual_seed(100 + M)
        ids2 = torch.stack([torch.randperm(8, generator=lg)[:2] for _ in range(M)]).int()
        w2t = torch.rand(M, 2, generator=lg)
        w2t = w2t / w2t.sum(-1, keepdim=True)
        nexp = len(set(ids2.reshape(-1).tolist()))
        ids2d, w2d = ids2.cuda(), w2t.cuda()
        lay_tables = [torch.arange(8, dtype=torch.int32, device="cuda") + 8 * i for i in range(2)]
        ref_layer = _layer_ref(x, ids2, w2t, deq32)
        ref_one = _layer_ref(x, torch.zeros(M, 1, dtype=torch.int32), torch.ones(M, 1), deq32)
        tried = []
        for cfg in cands:
            wsl = Workspace(M, 2, H, FF, 8, "cuda")
            errs = []
            for _ in range(3):                   # three runs: a race shows as a changing error
                got = moe_triton(x, ids2d, w2d, lay_tables[0], pool, lay, workspace=wsl, config=cfg,
                                 out_dtype=torch.float32)
                errs.append(_rel_err(got, ref_layer))
            one = moe_triton(x, ids, wts, tables[0], pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
            e1 = _rel_err(one, ref_one)
            rec = {"config": asdict(cfg), "layer_rel_err": errs, "expert_rel_err": e1}
            if max(errs + [e1]) < 1e-2:
                rec["layer_us"] = graph_us([lambda t=t: moe_triton(x, ids2d, w2d, t, pool, lay, workspace=wsl,
                                                                   config=cfg) for t in lay_tables])
            print(f"M={M} candidate {cfg}: errors layer {[f'{v:.1e}' for v in errs]} expert {e1:.1e}"
                  f" layer {rec.get('layer_us', float('nan')):.1f} us", flush=True)
            tried.append(rec)
        ok = [t for t in tried if "layer_us" in t]
        if not ok:
            print(f"M={M}: no candidate passed", flush=True)
            continue
        # "mine" is what the executor runs (the committed entry) when it is right; else the fastest right one
        mine = [t for t in ok if t["config"] == asdict(committed)]
        pick = mine[0] if mine else min(ok, key=lambda t: t["layer_us"])
        from cmoe.executor.kernels_triton import KernelConfig
        cfg = KernelConfig(**pick["config"])
        wsl = Workspace(M, 2, H, FF, 8, "cuda")
        r = {"M": M, "config": asdict(cfg), "candidates": tried, "layer_rel_err": max(pick["layer_rel_err"]),
             "expert_rel_err": pick["expert_rel_err"], "layer_experts": nexp, "committed": bool(mine),
             "layer_triton_best": min((t["layer_us"] for t in ok if not (t["config"]["cu13"] or t["config"]["cu2"])),
                                      default=float("nan"))}
        r["w13_mine"] = graph_us([lambda t=t: K.launch_w13(ws, x, t, pool, lay, 1, cfg) for t in tables])
        r["w2_mine"] = graph_us([lambda t=t: K.launch_w2(ws, wts, t, pool, lay, 1, M, cfg) for t in tables])
        r["expert_mine"] = graph_us([lambda t=t: moe_triton(x, ids, wts, t, pool, lay, workspace=ws, config=cfg)
                                     for t in tables])
        r["layer_mine"] = graph_us([lambda t=t: moe_triton(x, ids2d, w2d, t, pool, lay, workspace=wsl, config=cfg)
                                    for t in lay_tables])
        torch_rows(r, x, hM, ex, ids2, w2t, nexp, lay.nbytes, (b13, b2, bf13, bf2))
        rows.append(r)
        print(f"M={M} done ({time.time() - t0:.0f} s)", flush=True)
        res["table"] = rows
        (out / "expert_kernel_h200.json").write_text(json.dumps(res, indent=1, default=str))

    print_table(res, rows)

if __name__ == "__main__":
    os.environ.setdefault("TORCH_CUDNN_V8_API_DISABLED", "1")
    main()
