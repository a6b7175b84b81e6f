"""A CPU expert's costs from calibrate's `static` runs (`log_points.cpu_in_model`): its time at one
token and per further token, and how much longer it takes after the CPU idled (`cpu_wake_points`).

Why the idle: on an H100's host (twenty-eighth session) a one-token Mixtral expert took 1.32-1.50
ms when it followed another within 0.1 ms and 1.9-2.0 ms after more than 2 ms of idle; a model
that held one mean predicted the pools that keep most experts resident (CPU experts far apart)
up to 39% fast, and batch 8's back-to-back experts 16% slow. So the base is the back-to-back
experts' (idle under `IDLE_BINS_US[1]`), and each idle bin's extra is its experts' time over
that base, pooled over token counts: an extra time, not a factor (there the extra was ~0.2-0.5
ms at 1 to 4 tokens alike, where a factor would have charged 4 tokens twice what it charged one).
"""

from __future__ import annotations

from cmoe.calibrate.link_fit import fit_line
from cmoe.calibrate.log_points import IDLE_BINS_US

LEAST = 5                                  # experts an idle bin needs to give its extra


def cpu_expert_fit(m: dict) -> tuple[float, float, tuple]:
    """(seconds at one token, per extra token, cpu_wake_points): inside the running model where
    measured (each point counted as often as it was seen), from the back-to-back experts with each
    idle bin's extra (us) where two idle bins or more were measured, else the isolated loop's line."""
    ca, cb = fit_line([(t - 1, s) for t, s in m["cpu_expert"]["points"]])
    inm = m.get("cpu_expert_in_model")
    if not inm:
        return ca, cb, ()
    pooled = ca, cb = fit_line([(t - 1, s) for t, s in inm["points"]], [n for _, n in inm.get("count", [])] or None)
    rows = inm.get("idle") or []
    short = [r for r in rows if r[1] < IDLE_BINS_US[1]]
    if sum(r[4] for r in short) < LEAST:
        return (*pooled, ())
    if len({r[0] for r in short}) > 1:
        ca, cb = fit_line([(r[0] - 1, r[3]) for r in short], [r[4] for r in short])
    else:                                  # one token count back to back: its level, the slope of all
        t, s = short[0][0], sum(r[3] * r[4] for r in short) / sum(r[4] for r in short)
        ca = s - cb * (t - 1)
    base = lambda t: ca + cb * (t - 1)     # noqa: E731
    wake = []
    for lo in IDLE_BINS_US:
        got = [r for r in rows if r[1] == lo and base(r[0]) > 0]
        n = sum(r[4] for r in got)
        if n >= LEAST:
            wake.append((sum(r[2] * r[4] for r in got) / n, max(sum((r[3] - base(r[0])) * r[4] for r in got) / n * 1e6, 0.0)))
    return (ca, cb, tuple(wake)) if len(wake) > 1 else (*pooled, ())   # no idle measured: every expert's mean


def cpu_layer_fields(m: dict) -> dict:
    """The host around a CPU layer's experts (`cpu_lead_us`, `cpu_gap_us`, `cpu_tail_us`) and the
    round trip by batch (`roundtrip_points`, where two batches or more were measured)."""
    got = {f"cpu_{k}_us": v * 1e6 for k, v in (m.get("cpu_step") or {}).items()}
    if len(m.get("roundtrip_points") or []) > 1:
        got["roundtrip_points"] = tuple((int(b), s * 1e6) for b, s in m["roundtrip_points"])
    return got


def cpu_rows(row, m: dict, p) -> None:
    """`profile_fit.beside`'s CPU rows: the isolated experts, the in-model ones by tokens and (with
    `cpu_wake_points`) by idle, the round trip and the host around a CPU layer's experts."""
    cpu = m["cpu_expert"]
    for t, s in cpu["points"]:
        row(f"CPU expert, {t} tokens", s, p.cpu_expert_us(cpu["bytes"], t))
    for t, s in (m.get("cpu_expert_in_model") or {}).get("points", []):
        row(f"CPU expert in model, {t} tok", s, p.cpu_expert_us(cpu["bytes"], t))
    for t, _, idle, s, n in (m.get("cpu_expert_in_model") or {}).get("idle", []) if p.cpu_wake_points else ():
        if n >= LEAST:
            row(f"CPU expert {t} tok, {idle:.0f}us idle", s, p.cpu_expert_us(cpu["bytes"], t) + p.cpu_wake_us(idle))
    row("round trip", m["roundtrip"], p.roundtrip_us)
    if m.get("roundtrip_in_model"):
        row("round trip in model", m["roundtrip_in_model"], p.roundtrip_us)
    for b, s in m.get("roundtrip_points") or [] if p.roundtrip_points else ():
        row(f"round trip in model, {b} rows", s, p.roundtrip(b))
    for k, s in (m.get("cpu_step") or {}).items():
        row(f"CPU layer, host {k}", s, getattr(p, f"cpu_{k}_us"))
