"""A fitted profile beside the measurements it was fitted to, as `cmoe calibrate` prints it: each
measurement, what the profile predicts for it, and the spread of its repeats."""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.cpu_fit import cpu_rows
from cmoe.calibrate.link_fit import best_per_size, curve
from cmoe.calibrate.noise import point_label, size_label
from cmoe.calibrate.profile_fit import noise_of
from cmoe.calibrate.wake import loading_boundary, pass_start_means
from cmoe.core.hw import GB, HardwareProfile


def beside(p: HardwareProfile, m: dict) -> str:
    """Each measurement next to what the fitted profile predicts for it, and the spread of its
    repeats (relative IQR, `noise.spread`; '-' where it was measured once or is a mean over a run)."""
    spreads = dict(noise_of(m).spreads)
    rows = [f"{'what':<28} {'measured':>12} {'fitted':>12} {'spread':>7}"]

    def row(label: str, seconds: float, fitted_us: float | None, key: str | None = None) -> None:
        fit = f"{fitted_us:10.1f}us" if fitted_us is not None else f"{'-':>12}"
        key = key or label                                  # the repeats' name for it, where it differs
        sp = f"{spreads[key] * 100:6.1f}%" if key in spreads else f"{'-':>7}"
        rows.append(f"{label:<28} {seconds * 1e6:10.1f}us {fit} {sp}")
    note = _link_rows(row, m, p)
    for kind, key in (("H2D pageable", "h2d_pageable_points"), ("D2H pageable", "d2h_pageable_points")):
        for b, s in best_per_size(m.get(key) or []):
            row(f"{kind} {size_label(b)}", s, p.h2d_us(b, pinned=False) if kind.startswith("H2D") else None)
    row(f"device copy {size_label(m['hbm'][0])}", m["hbm"][1], m["hbm"][0] / (p.hbm_gbps * GB) * 1e6)
    row("matmul", m["matmul"][1], None)             # the profile's rate is the experts' extra-token slope
    for ex, what in [(m["expert"], "expert")] + [(oc, f"{oc['format']} expert") for oc in m.get("expert_classes") or []
                                                 if "points" in oc]:
        for t, s in ex["points"]:
            row(f"{what}, {t} tokens", s, p.expert_us(ex["bytes"], ex["bits"], t, ex["params"]))
    rb = m["layer"].get("resident_bytes", 0)
    for t, s in m["layer"]["points"]:
        row(f"layer (non-expert), {t} tok", s, p.layer_us(t, rb))
    per_key = p.attn_us_per_ctx_token + p.attn_us_per_cache_key
    caches = m["layer"].get("context_caches") or [0, 0]
    for (keys, sec), c in zip(m["layer"].get("context_points") or [], caches):
        row(f"layer, {round(keys)} keys", sec, p.layer_us(1, rb) + per_key * keys + p.attn_split_us(c),
            point_label("layer, context", "keys", keys))
    if sp := m["layer"].get("split_point"):
        row(f"layer, {round(sp[0])} keys of {sp[2]}", sp[1], p.layer_us(1, rb) + per_key * sp[0] + p.attn_split_us(sp[2]))
    h, py, q = m["layer"].get("host"), m["layer"].get("host_python"), p.python_step()
    for what, key, fn in (("host, layer", "layer_points", p.host_layer), ("host, route", "route_points", p.host_route),
                          ("host, one expert", "expert_points", p.host_expert)) if h else ():
        for t, s in h[key]:
            row(f"{what}, {t} tokens", s, fn(t))
    for what, key, fn in (("Py step, route", "route_points", q.host_route),
                          ("Py step, expert", "expert_points", q.host_expert)) if py and p.python_host else ():
        for t, s in py[key]:                               # the Python step's host (`python_step`)
            row(f"{what}, {t} tokens", s, fn(t))
    for wait, route in _wake_means((h or {}).get("wake_samples") or []):
        row(f"host, route after {wait * 1e6:.0f}us", route, p.host_route(1) * p.host_wake(wait * 1e6))
    for prev, start in pass_start_means((h or {}).get("pass_start_samples") or []).values():
        row(f"host, pass start after {prev / 1e3:.0f}ms", start / 1e6, p.host_pass_start_us + p.pass_start_extra_us(prev))
    if lb := loading_boundary((h or {}).get("loading_pass_start_samples") or []):    # `wake.fit_boundary`
        row(f"host, head, {lb.loads:.0f} loads", lb.head_us / 1e6, p.host_head_us)
        row("host, head + start, loading", lb.total_us / 1e6,
            p.boundary_price_us(lb.prev_us, 0.0 if np.isnan(lb.wait_us) else lb.wait_us))
    for b, n, quiet, busy, _, _ in m["layer"].get("launch_copy_points") or []:    # `launch_fit`
        row(f"launch of {n} beside a load, b{b}", busy, p.wave_beside_copy(quiet * 1e6, 0.0))
    if m["layer"].get("start_copy_s") is not None:         # oracle's passes that start beside a load
        row("pass start by a load, more", m["layer"]["start_copy_s"], p.start_copy_us)
    cpu_rows(row, m, p)
    return "\n".join(rows + ([note] if note else []))


def _link_rows(row, m: dict, p: HardwareProfile) -> str:
    """The pinned copies' rows, the largest copy's later rounds, calibrate's own loads (queued on a
    GPU: `queued_fit`; a CPU's in the model: `copied_fit`); returns the line that says, on a CPU,
    how far the loads moved the curve from the copies ('' elsewhere)."""
    note = ""
    for kind, pts, fn in (("H2D pinned", m["h2d"], p.h2d_us), ("D2H pinned", m["d2h"], p.d2h_us)):
        for b, s in best_per_size(pts):
            row(f"{kind} {size_label(b)}", s, fn(b))
        if kind == "H2D pinned" and pts:
            b, q = max(int(x) for x, _ in pts), m["layer"].get("load_queue")
            for i, s in enumerate(m.get("h2d_rounds") or [], 2):
                row(f"{kind} {size_label(b)}, round {i}", s, fn(b))
            if q and q[1] > 0:
                row(f"H2D queued load {size_label(q[0])}", q[1], p.h2d_queued(q[0]))
            if (c := m["layer"].get("load_copy")) and c[1] > 0 and p.copy_on_host:
                row(f"load in the model {size_label(c[0])}", c[1], p.h2d_queued(c[0]))
                alone = c[0] / (HardwareProfile.curve_gbps(curve(m["h2d"], m.get("h2d_rounds")), c[0]) * GB) * 1e6
                note = (f"(H2D pinned fitted: the copies' curve x{p.h2d_us(c[0]) / alone:.2f} in time, "
                        "as the loads in the model took)")
    return note


def _wake_means(samples: list) -> list[tuple[float, float]]:
    """(mean wait s, mean route step s) per lead of `cmoe.calibrate.wake`'s samples, by lead."""
    by: dict[float, list] = {}
    for lead, route, wait in samples:
        if route > 0:                 # as `fit_wake`: a run without a route step says nothing
            by.setdefault(lead, []).append((wait, route))
    return [(float(np.mean([w for w, _ in v])), float(np.mean([r for _, r in v]))) for _, v in sorted(by.items())]
