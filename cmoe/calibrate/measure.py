"""What `cmoe calibrate` measures, on the device at hand (CUDA, or the CPU for a CPU profile):
copies across sizes, device memory bandwidth, a large matmul, launch cost, one expert's FFN
against tokens, the host CPU running the same expert, the hidden-state round trip, the slowdown
a side-stream copy causes; and, from the executor's own timeline (`measure_model.py`), what the
model costs on the host and on the GPU. Returns the dictionary `cmoe.calibrate.profile_fit.fit_profile`
reads; every microbenchmark time is the best of several repeats, and every repeat is kept under
`repeats` (`Timings`), which `cmoe.calibrate.profile_fit.noise` judges.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import torch

from cmoe.core.errors import CmoeError
from cmoe.core.hugepages import huge_share, huge_zeros
from cmoe.executor.kernels import ExpertViews, ffn
from cmoe.executor.layout import expert_layout, slot_size
from cmoe.executor.store import random_expert
from cmoe.core.spec import ModelSpec


REPEATS = 9     # of a microbenchmark: the fit takes the fastest; the spread needs more than one slow repeat
LINK_ROUNDS = 4  # the largest pinned H2D copy timed once per step of `measure` (`profile_fit.curve` says why)


class Timings:
    """Best-of-N timer that keeps every repeat: `best` returns the fastest and files all of them
    under `curves[what]` (the measurements' `repeats`, see `cmoe.calibrate.profile_fit`)."""

    def __init__(self, device: torch.device):
        self.times = _timer(device)
        self.curves: dict[str, dict] = {}

    def best(self, what: str, unit: str | None, x, fn, repeats: int = REPEATS, inner: int = 1,
             grows: bool = True, judged: bool = True) -> float:
        ts = self.times(fn, repeats, inner)
        c = self.curves.setdefault(what, {"unit": unit, "grows": grows, "judged": judged, "points": []})
        c["points"].append([x, ts])
        return min(ts)


def _timer(device: torch.device):
    cuda = device.type == "cuda"

    def times(fn, repeats: int = 5, inner: int = 1, sync: bool = True) -> list[float]:
        """`repeats` timings of `inner` calls of fn (seconds per call); with `sync` (the default)
        after one untimed call and, on CUDA, each from a synchronised device; without, from where
        the streams stand (work queued on another stream goes on beside it: `_copy_slowdowns`)."""
        if sync:
            fn()
        out = []
        for _ in range(repeats):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if sync:
                    torch.cuda.synchronize(device)
                s.record()
                for _ in range(inner):
                    fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) / 1e3 / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                out.append((time.perf_counter() - t0) / inner)
        return out
    return times


def copies(device: torch.device, sizes: list[int]) -> dict:
    rec = Timings(device)
    cuda = device.type == "cuda"
    big = max(sizes)
    host = torch.empty(big, dtype=torch.uint8, pin_memory=cuda).random_()
    dev = torch.empty(big, dtype=torch.uint8, device=device)
    h2d, d2h = [], []
    for n in sizes:
        h2d.append((n, rec.best("H2D pinned", "bytes", n, lambda: dev[:n].copy_(host[:n], non_blocking=True))))
        d2h.append((n, rec.best("D2H pinned", "bytes", n, lambda: host[:n].copy_(dev[:n], non_blocking=True))))
    page = torch.empty(big, dtype=torch.uint8).random_()
    ph2d, pd2h = [], []                        # pageable memory: staged by the driver, synchronous
    for n in sizes:                            # shown, not judged: a quiet H200 spreads them 20-35%
        ph2d.append((n, rec.best("H2D pageable", "bytes", n, lambda: dev[:n].copy_(page[:n]), judged=False)))
        pd2h.append((n, rec.best("D2H pageable", "bytes", n, lambda: page[:n].copy_(dev[:n]), judged=False)))
    d2 = torch.empty_like(dev)
    hbm = (2 * big, rec.best("device copy", "bytes", 2 * big, lambda: d2.copy_(dev), grows=False))
    rounds: list[float] = []

    def link_round() -> None:
        """The largest pinned H2D copy again, best of REPEATS, into `h2d_rounds` (called later)."""
        rounds.append(min(rec.times(lambda: dev.copy_(host, non_blocking=True), REPEATS)))
    return {"h2d": h2d, "d2h": d2h, "h2d_pageable": ph2d[-1], "h2d_pageable_points": ph2d,
            "d2h_pageable_points": pd2h, "hbm": hbm, "h2d_rounds": rounds, "link_round": link_round,
            "repeats": rec.curves}


def compute(device: torch.device) -> dict:
    rec = Timings(device)
    cuda = device.type == "cuda"
    n = 4096 if cuda else 768
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    mm = rec.best("matmul", None, None, lambda: a @ b, grows=False)
    one = torch.zeros(1, device=device)
    t0 = time.perf_counter()
    for _ in range(200):
        one.add_(1)
    launch = (time.perf_counter() - t0) / 200
    if cuda:
        torch.cuda.synchronize(device)
    out = {"matmul": (2 * n**3, mm), "launch": launch, "copy_slowdown": 0.0, "repeats": rec.curves}
    if cuda:
        out.update(_copy_slowdowns(device, rec, lambda: a @ b))
    return out


SLOW_ROUNDS = 7   # paired rounds of the copy slowdown: a kernel alone, then under a side-stream copy


def _copy_slowdowns(device: torch.device, rec: Timings, matmul) -> dict:
    """What a side-stream H2D copy does to the kernels beside it: an HBM-bound device copy (what
    decode's kernels are; `copy_slowdown`, the profile's `copy_compute_slowdown`) and the matmul
    (`copy_slowdown_matmul`, shown). Each round times the kernel alone and then with the copy
    queued ahead of it, moments apart, and the figure is the median of the rounds' ratios; every
    round's is kept under `repeats`. Before the twenty-third session this timed the matmul after a
    device-wide synchronize, which waited for the copy: the "slowdown" (0.07-0.18 on one H100) was
    the matmul's drift against its own earlier best."""
    host = torch.empty(128 * 2**20, dtype=torch.uint8, pin_memory=True)   # 2.4 ms at 54 GB/s, each
    dev = torch.empty_like(host, device=device)
    src = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(device)

    def copying() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(4):                  # ~10 ms of copying: outlasts the kernels timed beside it
                dev.copy_(host, non_blocking=True)

    out = {}
    for key, fn, inner in (("copy_slowdown", lambda: dst.copy_(src), 20), ("copy_slowdown_matmul", matmul, 3)):
        fn()
        ratios = paired_slowdowns(lambda: rec.times(fn, 1, inner, sync=False)[0], copying,
                                  lambda: torch.cuda.synchronize(device), SLOW_ROUNDS)
        rec.curves[key.replace("_", " ")] = {"unit": None, "grows": False, "judged": False,   # busy / alone
                                             "points": [[None, [1.0 + r for r in ratios]]]}
        out[key] = float(np.median(ratios))
    return out


def paired_slowdowns(timed, copying, sync, rounds: int) -> list[float]:
    """Each round a pair, its order alternating so that neither side always comes first after a
    `sync()`: even rounds `timed()` alone, then `copying()` (queues the side copy) and `timed()`
    beside it; odd rounds the copy and `timed()` beside it, `sync()`, then `timed()` alone; `sync()`
    after each. The rounds' fractional slowdowns (busy / alone - 1)."""
    out = []
    for i in range(rounds):
        sync()
        if i % 2 == 0:
            alone = timed()
            copying()
            busy = timed()
        else:
            copying()
            busy = timed()
            sync()
            alone = timed()
        sync()
        out.append(busy / alone - 1.0)
    return out


def _expert_points(rec: Timings, what: str, device: torch.device, spec: ModelSpec, fmt: str,
                   tokens) -> tuple[object, list]:
    """One expert of format `fmt` on the device: (layout, [(tokens, seconds)]), every repeat filed
    in `rec` under `what`."""
    lay = expert_layout(fmt, spec.hidden, spec.expert_ffn)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    buf = torch.zeros(slot_size(lay), dtype=torch.uint8, device=device)
    random_expert(lay, 1, device, device.type, buf)
    v = ExpertViews(lay, buf, device.type)
    pts = []
    for t in tokens:
        x = torch.randn(t, spec.hidden, device=device).to(dt)
        pts.append((t, rec.best(what, "tokens", t, lambda: ffn(x, v), repeats=5, inner=5)))
    return lay, pts


def _bits(fmt: str, lay) -> int:
    return 4 if lay.group else (16 if fmt == "bf16" else 32)


# a CPU expert alone at these tokens: the shape past the in-model runs' token counts (`cpu_fit._extend`);
# torch's CPU int4 kernel steps between 4 and 5 tokens on an H100's host (twenty-ninth session)
CPU_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def random_cpu_experts(lay, n: int) -> list:
    """n random experts (seeds 1..n, `random_expert`) in this CPU's layout, as the executor's CPU
    path reads them."""
    out = []
    for i in range(n):
        buf = huge_zeros(slot_size(lay))                 # as the store's CPU experts (`cmoe.core.hugepages`)
        random_expert(lay, 1 + i, torch.device("cpu"), "cpu", buf)
        out.append(ExpertViews(lay, buf, "cpu"))
    return out


def _cpu_views(lay) -> list:
    """Random experts in this CPU's layout, together twice its last-level cache (1 to 8 of them):
    one expert timed over and over stays in cache where it fits (a Mixtral expert's 89 MB in the
    300 MiB L3 of the H100 host of the twenty-ninth session), which a run's CPU experts never are."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            raw = f.read().strip()
        llc = int(raw[:-1]) * {"K": 2**10, "M": 2**20}[raw[-1]] if raw[-1] in "KM" else int(raw)
    except (OSError, ValueError):
        llc = 64 * 2**20
    return random_cpu_experts(lay, min(8, max(1, -(-2 * llc // lay.nbytes))))


def expert(device: torch.device, spec: ModelSpec, fmt: str, tokens=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    rec = Timings(device)
    lay, pts = _expert_points(rec, "expert", device, spec, fmt, tokens)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    # the executor's other weight width on CUDA (int4 <-> bf16), so both of the profile's classes are measured
    others = []
    if device.type == "cuda":
        other = "bf16" if lay.group else "w4g128"
        try:
            olay, opts = _expert_points(rec, f"{other} expert", device, spec, other, tokens)
            others.append({"format": other, "bytes": olay.nbytes, "params": 3 * spec.hidden * spec.expert_ffn,
                           "bits": _bits(other, olay), "points": opts})
        except (CmoeError, RuntimeError) as e:    # shapes the int4 kernel cannot take: keep the h200 figure
            others.append({"format": other, "error": str(e).splitlines()[0]})
    crec = Timings(torch.device("cpu"))
    views = _cpu_views(lay)
    nxt = itertools.cycle(views).__next__                # each call the next expert: read from memory, as in a run
    cpts = [(t, crec.best("CPU expert", "tokens", t, lambda x=torch.randn(t, spec.hidden).to(dt): ffn(x, nxt()), repeats=3))
            for t in CPU_TOKENS]
    h = torch.randn(8, spec.hidden, device=device).to(dt)

    def roundtrip():
        back = h.to("cpu").to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return back
    return {"expert": {"bytes": lay.nbytes, "params": 3 * spec.hidden * spec.expert_ffn, "bits": _bits(fmt, lay),
                       "points": pts},
            "expert_classes": others, "cpu_expert": {"bytes": lay.nbytes, "points": cpts},
            # the pages they sat on; the in-model CPU runs' share replaces it (`measure_model`)
            "cpu_huge_pages": huge_share([t for v in views for t in (v.w13, v.w2)]),
            "roundtrip": rec.best("round trip", None, None, roundtrip, grows=False),
            "repeats": rec.curves | crec.curves}


def measure(device: torch.device, spec: ModelSpec, fmt: str, num_layers: int = 4, model_dir=None,
            progress: bool = True, built=None, cpu_experts: bool = True) -> dict:
    from tqdm import tqdm

    from cmoe.calibrate.measure_model import layers
    cuda = device.type == "cuda"
    sizes = [2**k for k in range(16, 29, 2)] if cuda else [2**k for k in range(16, 25, 2)]
    steps = [("copies", lambda: copies(device, sizes)), ("compute", lambda: compute(device)),
             ("expert", lambda: expert(device, spec, fmt)),
             ("layers", lambda: layers(device, spec, fmt, num_layers, model_dir, built=built,
                                       split_point=bool(out.get("attn_split_max")), cpu_experts=cpu_experts))]
    from cmoe.executor.engine import DENSE_ROWS
    from cmoe.executor.run import ExecConfig, uses_fused
    # the lean engine's layer kernel runs only the routed (row, expert) pairs; the per-expert loop
    # (float formats, shapes the tiled layout does not take) runs every expert on all of up to
    # DENSE_ROWS rows, and the simulator copies whichever this machine's executor does
    if built is not None and built.store is not None:
        fused = built.store.packing == "tiled"
    else:
        fused = fmt.startswith("w4") and uses_fused(ExecConfig(device=device.type), spec, device)
    from cmoe.executor import attention
    # the lean engine's decode attention (CUDA, the families it covers): rows side by side, each walking
    # the cache up to the step's slot, so its cost follows the longest row's keys, not their sum
    walks = cuda and fused and spec.family in attention.FAMILIES and attention.enabled()
    from cmoe.executor.lean_program import queues_passes
    out: dict = {"dense_rows": 0 if fused else DENSE_ROWS, "silent_upper": fused, "commit_ahead": fused,
                 "pass_overlap": queues_passes(cuda),
                 "attention_walks_cache": walks, "repeats": {}}
    if walks:                    # its keys cut into runs sized by the cache (the default mode): how many at most
        from cmoe.executor.kernels_triton.attention import BL, MAX_SPLITS, split_mode
        out |= {"attn_split_max": MAX_SPLITS if split_mode() == "1" else 0, "attn_split_block": BL}
    link_round = None
    for name, fn in tqdm(steps, desc="calibrate", disable=not progress):
        got = fn()
        out["repeats"].update(got.pop("repeats", {}))
        link_round = got.pop("link_round", link_round)
        out.update(got)
        if name != "copies" and link_round is not None and len(out["h2d_rounds"]) < LINK_ROUNDS - 1:
            link_round()                       # one round after each later step: spread over the minute
    out["sizes"] = np.array(sizes).tolist()
    return out


def host_cpu() -> str:
    """The host CPU's model name and its cores, as Linux names them ("" where it does not say). A CPU
    expert's time and the host's costs move with the host, and a lent GPU's host differs between
    loans: in the twenty-ninth session's probe it was a 16-core Xeon whose 300 MiB L3 holds a whole
    Mixtral expert (calibrate's isolated loop, one expert over and over, reads it from cache)."""
    from cmoe.executor.omp_wait import cores              # the mask from before libgomp bound the thread
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]}, {cores()} cores" if names else ""


def device_label_and_memory(device: torch.device) -> tuple[str, int]:
    """The device's name (what profiles are named after) and its memory in bytes."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
    return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(device: torch.device, spec: ModelSpec, fmt: str, num_layers: int = 4, model_dir=None,
              name: str | None = None, built=None, progress: bool = True, cpu_experts: bool = True):
    """Measure, then fit a profile (weight widths not measured keep the h200 profile's speeds).
    Returns the profile and the measurements it was fitted to. `built`: measure the layers on this
    already built workload (see `layers`). `cpu_experts` false (`cmoe calibrate --policy` naming
    GPU-only policies): build the model without CPU copies of its experts, as `cmoe run` of such
    policies does on a GPU, and run no CPU expert inside it on any device (`cmoe run` on a CPU
    still does): the profile then prices no CPU layer (`cpu_layer_unmeasured`)."""
    from cmoe.core.hw import H200
    from cmoe.calibrate.profile_fit import fit_profile, noise, with_expert_classes
    from cmoe.core.cpu_ref import cpu_ref_us
    ref = cpu_ref_us()                                 # the CPU's own speed while the host costs are measured
    m = measure(device, spec, fmt, num_layers, model_dir, progress=progress, built=built, cpu_experts=cpu_experts)
    ref = [ref, cpu_ref_us()]
    label, mem = device_label_and_memory(device)
    from cmoe.executor.few_experts import describe as few_describe
    from cmoe.executor.omp_wait import in_force
    m["device"] = {"label": label, "memory_bytes": mem, "date": time.strftime("%Y-%m-%d"), "host": host_cpu(),
                   "omp_wait_policy": in_force(),         # the CPU experts' speed depends on it (`omp_wait`)
                   # the launches' kernel configuration does on CMOE_FEW_EXPERTS (`few_experts`)
                   "few_experts": few_describe() if str(device).startswith("cuda") else "", "cpu_ref_us": ref}
    m["noise"] = noise(m["repeats"]).to_dict()
    prof = fit_profile(name or label.lower().replace(" ", "-"), m, mem, label, m["device"]["date"])
    return with_expert_classes(prof, H200), m
