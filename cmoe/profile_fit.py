"""Turn `cmoe calibrate`'s measurements into a HardwareProfile, and show each fitted model beside
the points it was fitted to. Pure arithmetic (numpy), no torch: the tests feed it synthetic
measurements made from known parameters and check that it gives them back.

Measurements (all times in seconds):
- `h2d`, `d2h`: [(bytes, seconds)] for pinned copies of several sizes -> bandwidth curves;
  `h2d_pageable`: (bytes, seconds) at the largest size, which the profile keeps (the simulator's
  loads are pinned); `h2d_pageable_points`, `d2h_pageable_points`: the same across sizes, shown;
- `hbm`: (bytes read + written, seconds) of a device-to-device copy;
- `matmul`: (flops, seconds) of a large product;
- `launch`: seconds per launch of a trivial kernel, host side;
- `expert`: {"bytes", "params", "bits", "points": [(tokens, seconds)]}: one expert's FFN ->
  t = 3 launch + bytes / bw + 2 params (tokens - 1) / rate, fitted as a line in tokens;
  `expert_classes`: the same for the executor's other weight width (int4 or bf16), whose
  bandwidth comes from the isolated loop's intercept;
- `layer`: {"resident_bytes", "points": [(tokens, seconds)], "pass_start_s", "head_s",
  "expert_in_model_s"}: from the executor's own timeline, the non-expert time of one decoder layer
  per pass (attention + route spans, the pass's start-up taken out), fitted as a line with the
  profile's weight-read term taken out of the intercept; the pass's start-up (layer 0's excess
  over the others) and LM head; and an expert kernel's time inside the running model at one
  token, which replaces the isolated loop's intercept (a layer's experts do not run back to back);
  and what predicting adds per MoE layer (`predict_layer_s`: a commit run's non-expert host time
  over upper's, all experts resident: the next layer's router, the larger read-back, OWA), charged
  to every policy that predicts; on CUDA these GPU-side times come from a run in which the GPU was
  held back so the host got ahead (the compute spans are then the GPU's own time);
  `context_points`: [(keys per decode token, seconds per layer)] of a short and a long-prompt run:
  attention's cost per key attended (`attn_us_per_ctx_token`);
  `host`: {"layer_points", "route_points", "expert_points": [(tokens, seconds)], "sync_s",
  "pass_start_s", "head_s"}: the host thread's side of the same, from the `host_*` spans;
- `cpu_expert`: {"bytes", "points": [(tokens, seconds)]}: one expert on the host's CPU;
- `roundtrip`: seconds to take a pass's hidden states to the host and back, synchronised;
- `copy_slowdown`: fractional slowdown of a matmul while a side-stream copy runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from cmoe.hw import GB, HardwareProfile

Points = list[tuple[float, float]]


def fit_line(points: Points, weights: list[float] | None = None) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x (each point counted `weights` times)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = np.ones_like(x) if weights is None else np.array(weights, dtype=float)
    if len(points) == 1 or np.ptp(x) == 0:
        return float(np.average(y, weights=w)), 0.0
    b, a = np.polyfit(x, y, 1, w=np.sqrt(w))
    return float(a), float(b)


def best_per_size(points: Points) -> list[tuple[int, float]]:
    """The fastest of the repeats at each size, ascending by size."""
    best: dict[int, float] = {}
    for b, s in points:
        best[int(b)] = min(best.get(int(b), math.inf), s)
    return sorted(best.items())


def curve(points: Points) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) copies -> ascending (bytes, GB/s) points."""
    return tuple((b, b / s / GB) for b, s in best_per_size(points))


def fit_profile(name: str, m: dict, gpu_mem_bytes: int, device: str, date: str) -> HardwareProfile:
    ex = m["expert"]
    a, b = fit_line([(t - 1, s) for t, s in ex["points"]])         # seconds at one token; per extra token
    a = m["layer"].get("expert_in_model_s", a)                      # inside the running model, if measured
    host_side = bool(m["layer"].get("host"))
    # with the host measured on its own, launching is the host's cost and the in-model time is the GPU's
    launch_s = 0.0 if host_side else m["launch"]
    expert_bw = ex["bytes"] / max(a - 3 * launch_s, 1e-9) / GB
    rate = 2 * ex["params"] / b / 1e12 if b > 0 else m["matmul"][0] / m["matmul"][1] / 1e12
    hbm = m["hbm"][0] / m["hbm"][1] / GB
    la, lb = fit_line([(t - 1, s) for t, s in m["layer"]["points"]])
    la -= m["layer"].get("resident_bytes", 0) / (hbm * GB)          # the profile adds weight reads itself
    ctx = m["layer"].get("context_points")                          # [(mean keys per token, seconds per layer)]
    per_key = 0.0
    if ctx and ctx[1][0] > ctx[0][0]:
        per_key = max((ctx[1][1] - ctx[0][1]) / (ctx[1][0] - ctx[0][0]), 0.0)
        la -= per_key * ctx[0][0]                                   # the short runs' keys, now priced per key
    cpu = m["cpu_expert"]
    ca, cb = fit_line([(t - 1, s) for t, s in cpu["points"]])
    if m.get("cpu_expert_in_model"):                                # inside the running model, if measured
        inm = m["cpu_expert_in_model"]
        ca, cb = fit_line([(t - 1, s) for t, s in inm["points"]], [n for _, n in inm.get("count", [])] or None)
    roundtrip = m.get("roundtrip_in_model") or m["roundtrip"]
    key = _class(ex["bits"])
    classes = [(key, expert_bw)]
    for oc in m.get("expert_classes") or []:                       # other widths: the isolated loop's intercept
        if "points" not in oc:
            continue
        oa, _ = fit_line([(t - 1, s) for t, s in oc["points"]])
        if _class(oc["bits"]) != key:
            classes.append((_class(oc["bits"]), oc["bytes"] / max(oa - 3 * launch_s, 1e-9) / GB))
    src = f"measured by cmoe calibrate on {device}, {date}"
    host = _host_fields(m["layer"].get("host"))
    return HardwareProfile(
        name=name, gpu_mem_bytes=gpu_mem_bytes, h2d_pinned=curve(m["h2d"]), d2h_pinned=curve(m["d2h"]),
        h2d_pageable_gbps=m["h2d_pageable"][0] / m["h2d_pageable"][1] / GB, copy_engines=1,
        hbm_gbps=hbm, matmul_tflops=rate,
        expert_gbps=tuple(classes), launch_us=launch_s * 1e6, layer_fixed_us=max(la, 0.0) * 1e6,
        attn_us_per_token=max(lb, 0.0) * 1e6, attn_us_per_ctx_token=per_key * 1e6, cpu_expert_gbps=cpu["bytes"] / max(ca, 1e-9) / GB,
        cpu_expert_us_per_token=max(cb, 0.0) * 1e6, roundtrip_us=roundtrip * 1e6, copy_compute_slowdown=max(m.get("copy_slowdown", 0.0), 0.0),
        pass_start_us=m["layer"].get("pass_start_s", 0.0) * 1e6, head_us=m["layer"].get("head_s", 0.0) * 1e6,
        predict_layer_us=m["layer"].get("predict_layer_s", 0.0) * 1e6,
        commit_route_us=m["layer"].get("commit_route_s", 0.0) * 1e6, copy_fifo=True,
        copy_on_host=device.lower() == "cpu", dense_rows=int(m.get("dense_rows", 0)), **host,
        sources={k: src for k in ("h2d_pinned", "d2h_pinned", "h2d_pageable_gbps", "hbm_gbps", "expert_gbps",
                                  "launch_us", "layer_fixed_us", "attn_us_per_token", "cpu_expert_gbps",
                                  "roundtrip_us", "copy_compute_slowdown", "pass_start_us", "head_us",
                                  "predict_layer_us", "commit_route_us", "cpu_expert_us_per_token",
                                  "attn_us_per_ctx_token", *host)}
        | {"matmul_tflops": src + " (slope of expert time over tokens: the rate extra tokens cost)",
           "copy_engines": "one copy stream, as the executor uses",
           "copy_fifo": "the executor issues every load to one copy stream, which runs them in issue order",
           "copy_on_host": "the executor on a CPU copies on its own thread; on a GPU a copy engine does",
           "dense_rows": "the executor's DENSE_ROWS: up to that many rows every expert runs on all of them"})


def _class(bits: float) -> str:
    return "int4" if bits <= 4 else "int8" if bits <= 8 else "bf16"


def _host_fields(h: dict | None) -> dict:
    """The host thread's costs, from the executor's `host_*` spans (lines in tokens)."""
    if not h:
        return {}
    out = {}
    for key, pts in (("layer", "layer_points"), ("route", "route_points"), ("expert", "expert_points")):
        a, b = fit_line([(t - 1, s) for t, s in h[pts]])
        slope = {"layer": "host_attn_us_per_token", "route": "host_route_us_per_token",
                 "expert": "host_expert_us_per_token"}[key]
        out[f"host_{key}_us"], out[slope] = max(a, 0.0) * 1e6, max(b, 0.0) * 1e6
    out["host_expert_tail_us"] = h.get("expert_tail_s", 0.0) * 1e6
    out["host_load_us"] = h.get("load_s", 0.0) * 1e6
    out["host_sync_us"] = h["sync_s"] * 1e6
    out["host_pass_start_us"] = h["pass_start_s"] * 1e6
    out["host_head_us"] = h["head_s"] * 1e6
    return out


def with_expert_classes(p: HardwareProfile, base: HardwareProfile) -> HardwareProfile:
    """Keep the base profile's speeds for weight widths that were not measured."""
    have = dict(p.expert_gbps)
    merged = tuple((k, have.get(k, v)) for k, v in base.expert_gbps)
    return replace(p, expert_gbps=merged)


def beside(p: HardwareProfile, m: dict) -> str:
    """Each measurement next to what the fitted profile predicts for it."""
    rows = [f"{'what':<28} {'measured':>12} {'fitted':>12}"]
    for kind, pts, fn in (("H2D pinned", m["h2d"], p.h2d_us), ("D2H pinned", m["d2h"], p.d2h_us)):
        for b, s in best_per_size(pts):
            rows.append(f"{kind + ' ' + _size(b):<28} {s * 1e6:10.1f}us {fn(b):10.1f}us")
    for kind, key in (("H2D pageable", "h2d_pageable_points"), ("D2H pageable", "d2h_pageable_points")):
        for b, s in best_per_size(m.get(key) or []):
            fitted = f"{p.h2d_us(b, pinned=False):10.1f}us" if kind.startswith("H2D") else f"{'-':>12}"
            rows.append(f"{kind + ' ' + _size(b):<28} {s * 1e6:10.1f}us {fitted}")
    ex = m["expert"]
    for t, s in ex["points"]:
        rows.append(f"{'expert, ' + str(t) + ' tokens':<28} {s * 1e6:10.1f}us "
                    f"{p.expert_us(ex['bytes'], ex['bits'], t, ex['params']):10.1f}us")
    rb = m["layer"].get("resident_bytes", 0)
    for t, s in m["layer"]["points"]:
        rows.append(f"{'layer (non-expert), ' + str(t) + ' tok':<28} {s * 1e6:10.1f}us {p.layer_us(t, rb):10.1f}us")
    for keys, sec in m["layer"].get("context_points") or []:
        rows.append(f"{'layer, ' + str(round(keys)) + ' keys':<28} {sec * 1e6:10.1f}us "
                    f"{p.layer_us(1, rb) + p.attn_us_per_ctx_token * keys:10.1f}us")
    h = m["layer"].get("host")
    if h:
        for what, key, fn in (("host, layer", "layer_points", p.host_layer), ("host, route", "route_points", p.host_route),
                              ("host, one expert", "expert_points", p.host_expert)):
            for t, s in h[key]:
                rows.append(f"{what + ', ' + str(t) + ' tok':<28} {s * 1e6:10.1f}us {fn(t):10.1f}us")
    cpu = m["cpu_expert"]
    for t, s in cpu["points"]:
        rows.append(f"{'CPU expert, ' + str(t) + ' tokens':<28} {s * 1e6:10.1f}us {p.cpu_expert_us(cpu['bytes'], t):10.1f}us")
    for t, s in (m.get("cpu_expert_in_model") or {}).get("points", []):
        rows.append(f"{'CPU expert in model, ' + str(t) + ' tok':<28} {s * 1e6:10.1f}us {p.cpu_expert_us(cpu['bytes'], t):10.1f}us")
    rows.append(f"{'round trip':<28} {m['roundtrip'] * 1e6:10.1f}us {p.roundtrip_us:10.1f}us")
    if m.get("roundtrip_in_model"):
        rows.append(f"{'round trip in model':<28} {m['roundtrip_in_model'] * 1e6:10.1f}us {p.roundtrip_us:10.1f}us")
    return "\n".join(rows)


def _size(b: int) -> str:
    return f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 2**10:g} KiB"


def refit_profile(path, name: str | None = None) -> tuple[HardwareProfile, dict]:
    """Fit again to measurements `cmoe calibrate` wrote (after the fitting itself changed)."""
    import json
    from pathlib import Path

    from cmoe.errors import CmoeError
    from cmoe.hw import H200
    try:
        m = json.loads(Path(path).read_text())
        dev = m["device"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CmoeError(f"{path} is not a measurements file written by cmoe calibrate ({e})") from None
    label = dev["label"]
    prof = fit_profile(name or label.lower().replace(" ", "-"), m, dev["memory_bytes"], label, dev["date"])
    return with_expert_classes(prof, H200), m
