"""Turn `cmoe calibrate`'s measurements into a HardwareProfile, and show each fitted model beside
the points it was fitted to. Pure arithmetic (numpy), no torch: the tests feed it synthetic
measurements made from known parameters and check that it gives them back.

Measurements (all times in seconds):
- `h2d`, `d2h`: [(bytes, seconds)] for pinned copies of several sizes -> bandwidth curves;
  `h2d_pageable`: (bytes, seconds) at the largest size, which the profile keeps (the simulator's
  loads are pinned); `h2d_pageable_points`, `d2h_pageable_points`: the same across sizes, shown;
  `h2d_rounds`: [seconds]: the largest pinned H2D copy's best again after each later step of the
  calibration (`LINK_ROUNDS`), whose median with the first round's sets the line's top point;
- `hbm`: (bytes read + written, seconds) of a device-to-device copy;
- `matmul`: (flops, seconds) of a large product;
- `launch`: seconds per launch of a trivial kernel, host side;
- `expert`: {"bytes", "params", "bits", "points": [(tokens, seconds)]}: one expert's FFN ->
  t = 3 launch + bytes / bw + 2 params (tokens - 1) / rate, fitted as a line in tokens;
  `expert_classes`: the same for the executor's other weight width (int4 or bf16), whose
  bandwidth comes from the isolated loop's intercept;
- `layer`: {"resident_bytes", "points": [(tokens, seconds)], "pass_start_s", "head_s",
  "expert_in_model_s", "expert_points": [(batch, seconds)], "context_points": [(keys, seconds)]}:
  from the executor's own timeline, the non-expert time of one decoder layer
  per pass (attention + route spans, the pass's start-up taken out), fitted as a line with the
  profile's weight-read term taken out of the intercept; the pass's start-up (layer 0's excess
  over the others) and LM head; and an expert kernel's time inside the running model at one
  token, which replaces the isolated loop's intercept (a layer's experts do not run back to back),
  and at each batch, which gives the per-expert loop's table its excess (`_expert_rows_table`);
  the layer at a short and a long prompt (medians of runs), which prices attention per key;
  and what predicting adds per MoE layer (`predict_layer_s`: a commit run's non-expert host time
  over upper's, all experts resident: the next layer's router, the larger read-back, OWA), charged
  to every policy that predicts; on CUDA these GPU-side times come from a run in which the GPU was
  held back so the host got ahead (the compute spans are then the GPU's own time);
  `readback_gpu_s` and `predict_gpu_s` (the lean engine, whose A_m is a CUDA graph): what a layer's
  attention span gains on the GPU when the policy reads back (all-resident `ondemand` over `upper`,
  median over batches) and when it predicts (`lru-prefetch` over `ondemand`, batch 1);
  `commit_gpu_s`, `commit_gpu_copy_s`: commit's `route` spans on the compute stream (its decode
  layers but the first, median; `cmoe.calibrate.commit_steps`): the read-back's start and the
  launch's inputs copied between attention and launch, and what they take more while a load moves;
  `readback_copy_s`, `launch_copy_s`: the same for a read-back policy's route and launch (`lru-prefetch`);
  `start_copy_s` (optional): what a queued pass's start-up takes more beside a moving load (`oracle`);
  `commit_start_excess_s`: commit's layer 0 over upper's (each over its other layers, batch 1, every
  expert resident), of which all but `host_sync_us` is `commit_start_us`;
  `context_points`: [(keys per decode token, seconds per layer)] of a short and a long-prompt run:
  attention's cost per key attended (`attn_us_per_ctx_token`; with `attention_walks_cache`, the
  lean engine's kernel, per key of the longest row, `attn_us_per_cache_key`: its rows run side by
  side, so batch 8 costs what its longest row does); with "split_point", "context_caches" and the
  top-level "attn_split_max", "attn_split_block", what the runs the cache is cut into cost
  (`cmoe.calibrate.layer_fit`);
  `host`: {"layer_points", "route_points", "expert_points": [(tokens, seconds)], "sync_s",
  "pass_start_s", "head_s"}: the host thread's side of the same, from the `host_*` spans; on CUDA
  also "wake_points" [[wait s, factor]], "wake_samples" [[lead us, route s, wait s]],
  "pass_start_samples" [[lead us, [[pass us, gap us, gap from the GPU's end us, excess us, head us,
  loads, last read-back wait us, the next pass's host us a layer]]]] (`cmoe.calibrate.wake`; older files end at the
  head, or at the wait before the fiftieth session), "loading_pass_start_samples" (the same pairs of the ondemand run
  that loads every layer: `host_boundary_points`, where they carry the wait) and "route_waits" [(tokens, seconds)], the
  wait each route point followed;
- `cpu_expert`: {"bytes", "points": [(tokens, seconds)]}: one expert on the host's CPU;
- `cpu_step` (optional): {"lead", "gap", "tail", "pass_start", "pass_gap"} seconds, the host's own
  time around a layer's CPU experts and a CPU-expert policy's pass start (`log_points._cpu_steps`),
  read into `cpu_lead_us`, `cpu_gap_us`, `cpu_tail_us`, `cpu_pass_start_us`, `cpu_pass_gap_us`;
- `cpu_pass_points` (optional): [[CPU layers of the pass before, rows, pass start s, gap s]] per
  pair of queued decode passes of the same runs, recorded, not fitted (the slope moved 1.0-3.9 us a
  layer between hosts);
- `device`: {"label", "memory_bytes", "date", "host", "omp_wait_policy", "few_experts", "cpu_ref_us"}:
  the machine, the OpenMP settings the CPU experts ran under (wait policy and binding,
  `cmoe.executor.omp_wait`), the few-expert switch the launches ran under (optional,
  `cmoe.executor.few_experts.describe`), kept as the profile's, and the host CPU's plain loop
  before and after the measurements (optional, `cmoe.core.cpu_ref`), their mean `cpu_ref_us`;
- `cpu_huge_pages` (optional): the share of the CPU experts' bytes on 2 MiB pages (the in-model
  runs', else the isolated ones' of `cpu_expert`), kept as
  `cpu_pages` ("2 MiB pages" or "4 KiB pages", `cmoe.core.hugepages.pages_word`);
- `roundtrip`: seconds to take a pass's hidden states to the host and back, synchronised;
- `copy_slowdown`: fractional slowdown of an HBM-bound kernel while a side-stream copy runs
  (`copy_slowdown_matmul`: of a matmul, shown; `cmoe.calibrate.measure._copy_slowdowns`); where
  `layer` has "copy_slow" {"attention", "expert"} (the model's own kernels in a loading run,
  `cmoe.calibrate.commit_steps.copy_slowdowns`) those set the profile's two factors instead, and
  where it has "launch_copy_points" (lru-prefetch's fused launches beside a load and not, two
  launch sizes at least 20% apart in time: `launch_fit`) the experts' factor and `copy_launch_us`
  come from those;
- `repeats`: {what: {"unit": "bytes" | "tokens" | null, "grows": bool, "judged": bool, "points":
  [(x, [seconds of every repeat])]}}: the figures above are the best of these; `noise` judges the
  machine by them.

A busy machine measures anything (an int4 expert at 0.0045 GB/s, a 4 MiB copy slower than a 16 MiB
one) and the fit believes it, so the repeats are kept and judged: `noise` gives each point's spread,
(max - min) / median of its repeats, and the curves that fall where they must grow (copy time with
size, expert time with rows); `Noise.line` is the one-line verdict calibrate prints and `--strict`
turns into a refusal; `run_verdict` is the line `cmoe run` prints beside its errors (the verdict
lives in `cmoe.calibrate.noise`; its names are re-exported here).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cmoe.calibrate.noise import (FALL_SLACK, JITTER_S, SPREAD_LIMIT, Noise, noise, point_label, run_verdict,
                                  size_label, spread, verdict)
from cmoe.core.errors import CmoeError
from cmoe.calibrate.link_fit import LINE_FROM, Points, best_per_size, copied_fit, curve, fit_line, queued_fit
from cmoe.core.hw import GB, HardwareProfile, table_us
from cmoe.core.hw_math import held
from cmoe.core.hugepages import pages_word
from cmoe.calibrate.host_fit import host_fields, host_sources, python_host
from cmoe.calibrate.layer_fit import layer_fit
from cmoe.calibrate.cpu_fit import SOURCES as CPU_SOURCES, cpu_expert_fit, cpu_layer_fields

# the noise verdict lives in cmoe.calibrate.noise, the link's curve and fit_line in cmoe.calibrate.link_fit,
# the layer's non-expert time in cmoe.calibrate.layer_fit, a profile beside its measurements in
# cmoe.calibrate.beside
__all__ = ["FALL_SLACK", "JITTER_S", "LINE_FROM", "Noise", "Points", "SPREAD_LIMIT", "best_per_size",
           "curve", "fit_line", "fit_profile", "noise", "noise_of", "point_label", "refit_profile", "run_verdict",
           "spread", "verdict", "with_expert_classes"]


def fit_profile(name: str, m: dict, gpu_mem_bytes: int, device: str, date: str) -> HardwareProfile:
    """The HardwareProfile `name` that measurements `m` (see the module docstring) give; its
    sources say they were measured on `device` on `date`."""
    # with the host measured on its own, launching is the host's cost and the in-model time is the GPU's
    launch_s = 0.0 if m["layer"].get("host") else m["launch"]
    key, classes, rate = _expert_fit(m, launch_s)
    hbm = m["hbm"][0] / m["hbm"][1] / GB
    la, lb, per_key, split = layer_fit(m, hbm)
    cpu = m["cpu_expert"]
    ca, cb, cpu_fields = cpu_expert_fit(m)
    roundtrip = m.get("roundtrip_in_model") or m["roundtrip"]
    around = cpu_layer_fields(m)
    src = f"measured by cmoe calibrate on {device}, {date}"
    host = host_fields(m["layer"].get("host"))
    if host and (gap := _pass_gap_us(m)):
        host["pass_gap_us"] = gap
    if host and m["layer"].get("commit_start_excess_s"):   # commit's layer 0 over upper's, less its read-back
        host["commit_start_us"] = max(m["layer"]["commit_start_excess_s"] * 1e6 - host["host_sync_us"], 0.0)
    py = python_host(m["layer"])
    table = _expert_rows_table(m, key)
    waves = _wave_fit(m.get("waves") or [])
    waves |= _owa_fit(m.get("commit_waves") or [], waves)
    # the lean kernel's rows run side by side: its per-key cost is per key of the longest row
    per_key_field = "attn_us_per_cache_key" if m.get("attention_walks_cache") else "attn_us_per_ctx_token"
    h2d, queued, link_k = queued_fit(m["layer"].get("load_queue"), curve(m["h2d"], m.get("h2d_rounds")))
    on_host = device.lower() == "cpu"                 # the executor on a CPU: its loads are the host's copies
    h2d, copy_k = copied_fit(m["layer"].get("load_copy") if on_host else None, h2d)
    slows, slow_src = _copy_terms(m, src)
    ref, ref_src = _cpu_ref(m, src)
    return HardwareProfile(
        name=name, gpu_mem_bytes=gpu_mem_bytes, h2d_pinned=h2d,
        d2h_pinned=curve(m["d2h"]), cpu_pages=pages_word(m.get("cpu_huge_pages")) or "",
        **{k: (m.get("device") or {}).get(k) or "" for k in _DEVICE_WORDS}, **ref,
        h2d_pageable_gbps=m["h2d_pageable"][0] / m["h2d_pageable"][1] / GB, copy_engines=1, hbm_gbps=hbm,
        matmul_tflops=rate, expert_gbps=tuple(classes), launch_us=launch_s * 1e6, layer_fixed_us=max(la, 0.0) * 1e6,
        attn_us_per_token=max(lb, 0.0) * 1e6, cpu_expert_gbps=cpu["bytes"] / max(ca, 1e-9) / GB,
        cpu_expert_us_per_token=max(cb, 0.0) * 1e6, roundtrip_us=roundtrip * 1e6, **slows,
        **{f: m["layer"].get(f.removesuffix("_us") + "_s", 0.0) * 1e6 for f in _LAYER_US}, copy_fifo=True,
        copy_on_host=on_host, dense_rows=int(m.get("dense_rows", 0)),
        silent_upper=bool(m.get("silent_upper", False)), commit_ahead=bool(m.get("commit_ahead", False)),
        pass_overlap=bool(m.get("pass_overlap", False)),
        **{per_key_field: per_key * 1e6}, **split,
        **host, **table, **waves, **queued, **around, **cpu_fields, python_host=py,
        sources={k: src for k in (*_MEASURED, per_key_field, *table)} | host_sources(host, src)
        | {k: src + (" (static's queued passes: one head to the next pass's first layer)" if "pass" in k
                     else " (around each CPU layer's experts in static's runs)") for k in around}
        | {k: src + f" ({CPU_SOURCES[k]})" for k in cpu_fields}
        | ({"python_host": src + " (ondemand with the host program off: the Python step's)"} if py else {})
        | slow_src | ref_src
        | {k: src + " (ondemand's loads queued back to back, over the curve's last rate)" for k in queued}
        | ({"h2d_pinned": src + f" (from {size_label(LINE_FROM)} up x{link_k:.4f}: as fast as ondemand's queued expert loads ran)"} if link_k != 1 else {})
        | ({"h2d_pinned": src + f" (x{copy_k:.4f}: as fast as ondemand's {size_label(m['layer']['load_copy'][0])} "
                                 "expert loads ran in the model)"} if copy_k != 1 else {})
        | {k: src + " (a short prompt in a cache as long as the long run's, beside the two context points)"
           for k in split}
        | {k: src + " (upper's fused launches in the model: time = wave_us + experts' bytes at wave_gbps + "
           "wave_row_us per row, least squares over every decode layer)" for k in waves if k != "owa_gpu_us"}
        | {k: src + " (commit's decode launches, every expert resident, over upper's fit: OWA on the device)"
           for k in waves if k == "owa_gpu_us"}
        | {"matmul_tflops": src + " (slope of expert time over tokens: the rate extra tokens cost)", **_EXECUTOR})


# per-layer figures calibrate keeps in seconds under m["layer"] ("head_s"), each a profile field in us ("head_us")
_LAYER_US = ("pass_start_us", "head_us", "predict_layer_us", "readback_gpu_us", "predict_gpu_us", "commit_route_us",
             "commit_gpu_us", "commit_gpu_copy_us", "readback_copy_us", "launch_copy_us")
_DEVICE_WORDS = ("omp_wait_policy", "few_experts")     # settings m["device"] records, kept as the profile's words
_MEASURED = ("h2d_pinned", "d2h_pinned", "h2d_pageable_gbps", "hbm_gbps", "expert_gbps", "launch_us", "layer_fixed_us",
             "attn_us_per_token", "cpu_expert_gbps", "roundtrip_us", "copy_compute_slowdown", "copy_attention_slowdown",
             "pass_start_us", "head_us", "predict_layer_us", "commit_route_us", "cpu_expert_us_per_token", "readback_gpu_us", "predict_gpu_us",
             "commit_gpu_us", "commit_gpu_copy_us", "readback_copy_us", "launch_copy_us")   # copy_launch_us: _copy_terms
START_COPY_UNMEASURED = ("not measured, so 0: calibrate's oracle run (made for the lean engine on CUDA) "
                         "had too few passes on a side, or none was made, or the calibration predates the figure")
_EXECUTOR = {      # the fields the executor's design sets, not a measurement
    "copy_engines": "one copy stream, as the executor uses",
    "copy_fifo": "the executor issues every load to one copy stream, which runs them in issue order",
    "copy_on_host": "the executor on a CPU copies on its own thread; on a GPU a copy engine does",
    "dense_rows": "the executor's DENSE_ROWS: up to that many rows every expert runs on all of them",
    "silent_upper": "the executor runs a layer's experts in one launch from a device-side slot table, "
                    "so upper has no host step",
    "commit_ahead": "the executor launches commit's committed experts before the layer's read-back "
                    "(OWA on the device)",
    "pass_overlap": "the executor queues graphed decode passes back to back (no sync between them)"}


def _cpu_ref(m: dict, src: str) -> tuple[dict, dict]:
    """({"cpu_ref_us": the mean of calibrate's readings of the plain loop}, its source); two {}
    where none was recorded (the field then keeps its 0)."""
    got = [float(x) for x in (m.get("device") or {}).get("cpu_ref_us") or () if x]
    if not got:
        return {}, {}
    return ({"cpu_ref_us": float(np.mean(got))},
            {"cpu_ref_us": src + " (a fixed pure-Python loop before and after the measurements, cmoe.core.cpu_ref)"})


def _owa_fit(points: list, waves: dict) -> dict:
    """`owa_gpu_us`: the mean excess of commit's decode launches ([experts, rows, seconds, mean
    expert bytes] per layer, every expert resident) over upper's fit for the same launch; {}
    without both."""
    if not points or not waves:
        return {}
    count = waves.get("wave_count_us")
    fit = [(table_us(count, p[0]) if count else waves["wave_us"]) + _shares_us(p, waves) for p in points]
    return {"owa_gpu_us": max(float(np.mean([p[2] * 1e6 - f for p, f in zip(points, fit)])), 0.0)}


def _shares_us(p: list, waves: dict) -> float:
    """What a launch's experts add to it under a wave fit: their bytes at wave_gbps and their rows,
    for a point [experts, rows, seconds, mean expert bytes]."""
    return p[0] * p[3] / (waves["wave_gbps"] * GB) * 1e6 + waves["wave_row_us"] * p[1]


def _wave_fit(points: list) -> dict:
    """The fused launch from [experts, rows, seconds, mean expert bytes] per layer: least squares
    of time = c + a * experts + b * rows, b dropped where it comes out negative (rows cost nothing
    measurable at decode sizes). {} without enough variety in the number of experts to separate
    a launch's fixed cost from its experts' (then each expert stays a kernel of its own)."""
    if len(points) < 3 or len({int(p[0]) for p in points}) < 2:
        return {}
    X, y = np.array([[1.0, p[0], p[1]] for p in points]), np.array([p[2] for p in points])
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    if coef[2] < 0:
        coef = np.append(np.linalg.lstsq(X[:, :2], y, rcond=None)[0], 0.0)
    c, a, b = (float(v) for v in coef)
    if a <= 0:
        return {}
    out = {"wave_gbps": float(np.mean([p[3] for p in points])) / a / GB, "wave_us": max(c, 0.0) * 1e6, "wave_row_us": b * 1e6}
    # the launch's own cost by expert count: what each count's launches take beyond their experts'
    # shares (the line bends: on the H200 two experts took 81 us where the line said 86, three 118 for 110)
    by: dict[int, list[float]] = {}
    for p in points:
        by.setdefault(int(p[0]), []).append(p[2] * 1e6 - _shares_us(p, out))
    out["wave_count_us"] = tuple((n, max(float(np.mean(v)), 0.0)) for n, v in sorted(by.items()))
    return out


def _expert_fit(m: dict, launch_s: float) -> tuple[str, list[tuple[str, float]], float]:
    """An expert's kernel: (its weight class, [(class, GB/s)] of it and of the other widths
    measured, the rate in TFLOP/s that extra tokens cost). Its time at one token is the one inside
    the running model where measured; the other widths' come from the isolated loop's intercept."""
    ex = m["expert"]
    a, b = fit_line([(t - 1, s) for t, s in ex["points"]])         # seconds at one token; per extra token
    a = m["layer"].get("expert_in_model_s", a)                      # inside the running model, if measured
    expert_bw = ex["bytes"] / max(a - 3 * launch_s, 1e-9) / GB
    rate = 2 * ex["params"] / b / 1e12 if b > 0 else m["matmul"][0] / m["matmul"][1] / 1e12
    key = _class(ex["bits"])
    classes = [(key, expert_bw)]
    for oc in m.get("expert_classes") or []:                       # other widths: the isolated loop's intercept
        if "points" not in oc:
            continue
        oa, _ = fit_line([(t - 1, s) for t, s in oc["points"]])
        if _class(oc["bits"]) != key:
            classes.append((_class(oc["bits"]), oc["bytes"] / max(oa - 3 * launch_s, 1e-9) / GB))
    return key, classes, rate


def _expert_rows_table(m: dict, key: str) -> dict:
    """The shape of an expert's time over rows, where the isolated curve is the kernel that will run
    (the per-expert loop): the isolated points plus what running inside the model adds to them.
    That excess is measured at each batch the calibration ran the model (`layer.expert_points`:
    on the dense path every expert runs on all the batch's rows, so batch = rows) and read between
    them by rows, held past the last (a hinge stays a hinge). An excess, not a factor: it is the
    loop's own work around the kernel (row gathers, the weighted add, launches), which grows
    little with rows. The factor taken at one row that this replaces scaled every row's time by
    it: on a 2-core CPU (2026-12-07, tiny-moe) 1.36x at one row made the 8-row experts of a
    batch-8 run 26% slower than measured (952 against 758 us), and batch 3's 26%."""
    ex = m["expert"]
    iso = tuple(best_per_size([(t, s) for t, s in ex["points"]]))
    if len(iso) < 2 or m.get("silent_upper"):
        return {}
    lay, dense = m["layer"], int(m.get("dense_rows", 0))
    inm = sorted((int(t), s) for t, s in lay.get("expert_points") or () if (t == 1 or t <= dense) and s > 0)
    if not inm and (lay.get("expert_in_model_s") or 0) > 0:
        inm = [(1, lay["expert_in_model_s"])]
    extra = tuple((t, s - table_us(iso, t)) for t, s in inm)
    # an excess may be negative (the model's run faster than the isolated loop's); never below half
    return {"expert_rows_us": tuple((int(t), max(s + held(extra, t, 0.0), s / 2) * 1e6) for t, s in iso),
            "expert_rows_bytes": int(ex["bytes"]), "expert_rows_class": key}


def _class(bits: float) -> str:
    return "int4" if bits <= 4 else "int8" if bits <= 8 else "bf16"


def _copy_terms(m: dict, src: str) -> tuple[dict, dict]:
    """What a moving load costs the work beside it, and each figure's source (`src`, what measured
    it, and how): the two copy slowdowns, from the model's own kernels beside its loads where
    calibrate saw enough of them (experts -> `copy_compute_slowdown`, the attention step ->
    `copy_attention_slowdown`), else, for each alone, the lone HBM-bound kernel's; and the
    start-up's wait, `start_copy_us` (0, and a source saying why, where it was not measured)."""
    own, proxy = m["layer"].get("copy_slow") or {}, max(m.get("copy_slowdown", 0.0), 0.0)
    model, lone = ("the model's own {} beside commit's loads, busy over quiet medians",
                   "an HBM-bound device copy alone and beside an H2D copy, the median of paired rounds"
                   if "copy_slowdown_matmul" in m else "no side-stream copy timed here (a CPU, or calibrated before)")
    out, why = {}, {}
    for key, field_, what in (("expert", "copy_compute_slowdown", "expert launches"),
                              ("attention", "copy_attention_slowdown", "attention steps")):
        mine = own.get(key)
        out[field_] = max(mine, 0.0) if mine is not None else proxy
        why[field_] = f"{src} ({model.format(what) if mine is not None else lone})"
    if (fit := launch_fit(m["layer"].get("launch_copy_points") or [])) is not None:
        out["copy_launch_us"], out["copy_compute_slowdown"] = fit[0] * 1e6, fit[1]
        why["copy_launch_us"] = why["copy_compute_slowdown"] = (
            f"{src} (lru-prefetch's fused launches beside its loads and not, "
            f"{len(m['layer']['launch_copy_points'])} points of (batch, experts a launch): extra = copy_launch_us + "
            "copy_compute_slowdown x the launch, weighted least squares)")
    out["start_copy_us"] = m["layer"].get("start_copy_s", 0.0) * 1e6
    why["start_copy_us"] = (f"{src} (oracle's passes that start beside a load, the first layer over the others)"
                            if "start_copy_s" in m["layer"] else START_COPY_UNMEASURED)
    return out, why


def launch_fit(points: list) -> tuple[float, float] | None:
    """(fixed seconds, factor) of a fused launch's extra beside a moving load, `extra = a + s x
    quiet`, from calibrate's `launch_copy_points` ([batch, experts, quiet s, busy s, quiet n, busy
    n]), each weighted by its smaller side; None under two launch sizes 20% apart in time (nothing
    tells the two parts apart: the profile keeps the one factor on the whole launch). A negative part
    is held at 0 and the other fitted alone. Why two parts: on the H200 (thirty-ninth session) a
    launch beside a load took 5.7-7.6 us more at two experts and 9.8-11.8 at eight, whatever share
    of it was commit's OWA (`HardwareProfile.wave_beside_copy`)."""
    pts = [(q, b - q, min(nq, nb)) for _, _, q, b, nq, nb in points]
    if len(pts) < 2 or max(q for q, _, _ in pts) < 1.2 * min(q for q, _, _ in pts):
        return None
    q, y, w = (np.array(v, dtype=float) for v in zip(*pts))
    a, k = np.linalg.lstsq(np.vstack([np.ones_like(q), q]).T * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
    if a < 0:
        return 0.0, max(float(np.sum(w * y * q) / np.sum(w * q * q)), 0.0)
    if k < 0:
        return max(float(np.sum(w * y) / np.sum(w)), 0.0), 0.0
    return float(a), float(k)


def _pass_gap_us(m: dict) -> float:
    """`pass_gap_us`: the host's part of a pass's start before its first mark, where the GPU idles
    between passes (the lean engine: a pass's start comes from upper's own run, the host's side
    being that gap plus layer 0's start-up excess, the GPU's side the excess alone; measurements
    from before the gap was kept give it as the difference). 0 elsewhere: the eager runs' host
    start-up is layer 0's own."""
    h = m["layer"]["host"]
    if "pass_gap_s" in h:
        return max(h["pass_gap_s"], 0.0) * 1e6
    if not m.get("waves"):
        return 0.0
    return max(h["pass_start_s"] - m["layer"].get("pass_start_s", 0.0), 0.0) * 1e6


def with_expert_classes(p: HardwareProfile, base: HardwareProfile) -> HardwareProfile:
    """Keep the base profile's speeds for weight widths that were not measured."""
    have = dict(p.expert_gbps)
    merged = tuple((k, have.get(k, v)) for k, v in base.expert_gbps)
    return replace(p, expert_gbps=merged)


def refit_profile(path, name: str | None = None) -> tuple[HardwareProfile, dict]:
    """Fit again to measurements `cmoe calibrate` wrote (after the fitting itself changed)."""
    import json
    from pathlib import Path

    from cmoe.core.hw import H200
    try:
        m = json.loads(Path(path).read_text())
        dev = m["device"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CmoeError(f"{path} is not a measurements file written by cmoe calibrate ({e})") from None
    label = dev["label"]
    prof = fit_profile(name or label.lower().replace(" ", "-"), m, dev["memory_bytes"], label, dev["date"])
    return with_expert_classes(prof, H200), m


def noise_of(m: dict, cpu_experts: bool = True) -> Noise:
    """The verdict on measurements calibrate wrote; files from before the repeats were kept give
    their copy and expert curves (best times only: falls, no spread). For runs without CPU experts
    (`cpu_experts` false: `cmoe run` of GPU-only policies, or `cmoe calibrate --policy` naming them,
    which calibrate with OpenMP's threads sleeping) the CPU experts' repeats are shown, not judged."""
    if "repeats" in m:
        return noise({k: c if cpu_experts or not k.startswith("CPU") else c | {"judged": False}
                      for k, c in m["repeats"].items()})
    old = {"H2D pinned": ("bytes", m.get("h2d")), "D2H pinned": ("bytes", m.get("d2h")),
           "expert": ("tokens", (m.get("expert") or {}).get("points"))}
    return noise({k: {"unit": u, "grows": True, "points": [(x, [s]) for x, s in best_per_size(pts)]}
                  for k, (u, pts) in old.items() if pts})
