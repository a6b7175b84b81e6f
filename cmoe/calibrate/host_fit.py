"""The host thread's costs from calibration's measurements (`cmoe.calibrate.profile_fit` fits the
rest): the compiled host program's, from the eager `ondemand` runs, and the executor's Python
step's, from the same runs with the program off (`cmoe.calibrate.host_runs._python_step`).

Why two: the Python step's route step and launches cost the host 10-20x the program's (an H100,
twenty-seventh session: the route 13 us against 0.6), and it plans every run with the program off
(`CMOE_HOST_PROGRAM=0`). Until the twenty-eighth session it planned the CPU-expert policies too
(`lfu-fallback`, `static`): one set of host costs predicted them 16-104% fast at pools 16-26 GB.
"""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.link_fit import fit_line
from cmoe.calibrate.wake import fit_boundary, fit_pass_start
from cmoe.core.hw import HOST_FIELDS, HOST_POINTS
from cmoe.core.hw_math import held


def host_fields(h: dict | None) -> dict:
    """The host thread's costs, from the executor's `host_*` spans: with two or more batch sizes, a
    table through the points (a cost that falls with batch keeps falling: no line clamped at its
    one-token value); the line's fields too, for profiles read by older code."""
    if not h:
        return {}
    out = {}
    for key, pts in (("layer", "layer_points"), ("route", "route_points"), ("expert", "expert_points")):
        a, b = fit_line([(t - 1, s) for t, s in h[pts]])
        slope = {"layer": "host_attn_us_per_token", "route": "host_route_us_per_token",
                 "expert": "host_expert_us_per_token"}[key]
        out[f"host_{key}_us"], out[slope] = max(a, 0.0) * 1e6, max(b, 0.0) * 1e6
        mean: dict[int, list[float]] = {}
        for t, sec in h[pts]:
            mean.setdefault(int(t), []).append(sec)
        if len(mean) >= 2:
            out[f"host_{key}_points"] = tuple((t, max(float(np.mean(v)), 0.0) * 1e6) for t, v in sorted(mean.items()))
    out["host_expert_tail_us"] = h.get("expert_tail_s", 0.0) * 1e6
    out["host_load_us"] = h.get("load_s", 0.0) * 1e6
    out["host_sync_us"] = h["sync_s"] * 1e6
    out["host_pass_start_us"] = h["pass_start_s"] * 1e6
    out["host_head_us"] = h["head_s"] * 1e6
    if h.get("wake_points"):          # the route step after a wait: [wait s, factor] -> (us, factor),
        out["host_wake_points"] = tuple((w * 1e6, f) for w, f in h["wake_points"])
        if h.get("route_waits"):      # and the wait each batch's route point followed, (tokens, us)
            out["host_route_waits"] = tuple((int(t), w * 1e6) for t, w in h["route_waits"])
    if pts := fit_pass_start(h.get("pass_start_samples") or []):    # the pass start after a long pass
        out["host_pass_start_points"] = tuple((float(p), float(e)) for p, e in pts)

    def quiet(prev: float) -> float:                   # the boundary as priced without it
        return out["host_head_us"] + out["host_pass_start_us"] + held(out.get("host_pass_start_points", ()), prev, 0.0)
    if pts := fit_boundary(h.get("loading_pass_start_samples") or [], quiet, out.get("host_wake_points", ())):
        out["host_boundary_points"] = tuple((float(w), float(e)) for w, e in pts)   # after a loading pass
    return out


def host_sources(host: dict, src: str) -> dict:
    """`host_fields`' sources: what measured them (`src`), and for the pass start's table how."""
    out = {k: src for k in host}
    if "host_pass_start_points" in host:
        out["host_pass_start_points"] = src + (" (ondemand at batch 1, GPU sleep before each layer's experts: each "
                                               "lead's pass start over the unled runs', at its pass before's length)")
    if "host_boundary_points" in host:
        out["host_boundary_points"] = src + (" (ondemand with top_k slots, every layer loading: its head and next "
                                             "pass start over the profile's price, at its last read-back wait, "
                                             "read down along host_wake_points)")
    return out


def python_host(layer: dict) -> dict:
    """`HardwareProfile.python_host`: the host fields the Python step's runs give (`host_python`,
    over the program's `host` where it measured nothing of its own: the wake, the loads), those
    the profile's host model holds; {} where it was not measured (a CPU, where nothing else runs)."""
    py = layer.get("host_python")
    if not py or not layer.get("host"):
        return {}
    got = host_fields(layer["host"] | {k: v for k, v in py.items() if v is not None})
    return {k: v for k, v in got.items() if k in HOST_FIELDS or k in HOST_POINTS}
