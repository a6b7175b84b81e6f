"""A CPU expert's costs from calibrate's `static` runs (`log_points.cpu_in_model`): its time at one
token and by tokens (`cpu_expert_points`), and how much longer it takes after the CPU idled
(`cpu_wake_points`).

Why the idle: on an H100's host (twenty-eighth session) a one-token Mixtral expert took 1.32-1.50
ms when it followed another within 0.1 ms and 1.9-2.0 ms after more than 2 ms of idle; a model
that held one mean predicted the pools that keep most experts resident (CPU experts far apart)
up to 39% fast, and batch 8's back-to-back experts 16% slow. So the time by tokens is the back-to-
back experts' (idle in the first of `IDLE_BINS_US`), and each later idle bin adds an extra over
it, the same at every token count (`_joint` fits both at once): an extra time, not a factor
(there the extra was ~0.2-0.5 ms at 1 to 4 tokens alike, where a factor would have charged 4
tokens twice what it charged one).
"""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.link_fit import fit_line
from cmoe.calibrate.log_points import IDLE_BINS_US
from cmoe.core.hw_math import table_us

LEAST = 5                                  # experts a token count or an idle bin needs to be fitted


SOURCES = {"cpu_wake_points": "static's CPU experts by the CPU's idle before them, over the back-to-back ones",
           "cpu_expert_points": "static's CPU experts by their tokens, fitted beside the idle's extras, over one "
                                "token's; past the model's token counts the isolated loop's shape"}


def by_tokens(rows: list) -> tuple:
    """`cpu_expert_points` from (tokens, seconds, count) rows: each token count seen `LEAST` times or
    more, its mean over the one-token mean; () unless one token and another count were seen."""
    sums: dict[int, list] = {}
    for t, s, n in rows:
        acc = sums.setdefault(int(t), [0.0, 0])
        acc[0], acc[1] = acc[0] + s * n, acc[1] + n
    got = {t: s / n for t, (s, n) in sorted(sums.items()) if n >= LEAST}
    return tuple((t, s / got[1]) for t, s in got.items()) if 1 in got and len(got) > 1 else ()


def cpu_expert_fit(m: dict) -> tuple[float, float, dict]:
    """(seconds at one token, per extra token, {"cpu_wake_points", "cpu_expert_points"} where
    measured): inside the running model where measured (each point counted as often as it was
    seen), from the time by tokens and each idle bin's extra fitted together (`_joint`) where the
    back-to-back experts and another idle bin were measured, else every expert's mean by tokens;
    the isolated loop's line where nothing was measured inside the model."""
    ca, cb = fit_line([(t - 1, s) for t, s in m["cpu_expert"]["points"]])
    inm = m.get("cpu_expert_in_model")
    if not inm:
        return ca, cb, {}
    counts = dict(inm.get("count", []))
    pooled = ca, cb = fit_line([(t - 1, s) for t, s in inm["points"]], [counts[t] for t, _ in inm["points"]] if counts else None)
    every = by_tokens([(t, s, counts.get(t, LEAST)) for t, s in inm["points"]])
    rows = inm.get("idle") or []
    base, extra, idle = _joint(rows)
    if not extra or 1 not in base:
        return (*pooled, _fields((), _extend(every, m["cpu_expert"]["points"])))
    n = {t: sum(r[4] for r in rows if r[0] == t) for t in base}
    tab = tuple((t, s / base[1]) for t, s in sorted(base.items())) if len(base) > 1 else ()
    slope = fit_line([(t - 1, s) for t, s in sorted(base.items())], [n[t] for t in sorted(base)])[1] if tab else cb
    wake = ((idle[IDLE_BINS_US[0]], 0.0),) + tuple((idle[lo], max(x, 0.0) * 1e6) for lo, x in sorted(extra.items()))
    return base[1], slope, _fields(wake, _extend(tab, m["cpu_expert"]["points"]))


def _joint(rows: list) -> tuple[dict, dict, dict]:
    """A CPU expert's seconds = base(tokens) + extra(idle bin), extra 0 back to back (the first
    bin), least squares over `cpu_in_model`'s (tokens, bin) cells weighted by their counts, each
    token count and bin seen `LEAST` times or more: ({tokens: base s}, {bin: extra s}, {bin: mean
    idle us}). Fitted together because the counts are not spread alike over the bins: at batch 8
    the back-to-back experts are a layer's second and rarely have 5 tokens, which follow the idle
    of a layer's GPU part (~0.5 ms on an H100); an extra read off one-token experts alone, or a
    factor by tokens read off the back-to-back ones alone, misses that. ({}, {}, {}) where the back-to-
    back experts are fewer than `LEAST`, where the cells cannot separate every term (a token count
    seen only in a bin that nothing else ties to the back-to-back ones) or where a time comes out
    at 0 or less: the caller then keeps every expert's mean."""
    ts = sorted(t for t in {r[0] for r in rows} if sum(r[4] for r in rows if r[0] == t) >= LEAST)
    kept = [r for r in rows if r[0] in ts]
    bins = sorted(lo for lo in {r[1] for r in kept} if lo > IDLE_BINS_US[0] and sum(r[4] for r in kept if r[1] == lo) >= LEAST)
    use = [r for r in kept if r[1] == IDLE_BINS_US[0] or r[1] in bins]
    if sum(r[4] for r in use if r[1] == IDLE_BINS_US[0]) < LEAST:
        return {}, {}, {}
    a = np.zeros((len(use), len(ts) + len(bins)))
    for i, r in enumerate(use):
        a[i, ts.index(r[0])] = 1.0
        if r[1] > IDLE_BINS_US[0]:
            a[i, len(ts) + bins.index(r[1])] = 1.0
    w = np.sqrt([r[4] for r in use])
    if np.linalg.matrix_rank(a * w[:, None]) < a.shape[1]:
        return {}, {}, {}
    sol = np.linalg.lstsq(a * w[:, None], np.array([r[3] for r in use]) * w, rcond=None)[0]
    if (sol[:len(ts)] <= 0).any():
        return {}, {}, {}
    idle = {lo: sum(r[2] * r[4] for r in use if r[1] == lo) / sum(r[4] for r in use if r[1] == lo)
            for lo in [IDLE_BINS_US[0], *bins]}
    return dict(zip(ts, sol[:len(ts)].tolist())), dict(zip(bins, sol[len(ts):].tolist())), idle


def _extend(tab: tuple, iso: list) -> tuple:
    """The in-model factors by tokens, continued past their last token count along the isolated
    loop's shape (its time at t over its time there): the model's runs see few experts with many
    tokens (at batch 8, 6 tokens in 3 of 3,550), and a table's last piece extended would carry the
    kernel's step at 5 tokens on (10.0 ms at 8 tokens where the loop measured 6.1)."""
    if not tab or len(iso) < 2:
        return tab
    iso = tuple(sorted((int(t), s) for t, s in iso))
    last, k = tab[-1]
    at = table_us(iso, last)
    return tab + tuple((t, k * s / at) for t, s in iso if t > last)


def _fields(wake: tuple, points: tuple) -> dict:
    return {k: v for k, v in (("cpu_wake_points", wake), ("cpu_expert_points", points)) if v}


def cpu_layer_fields(m: dict) -> dict:
    """The host around a CPU layer's experts (`cpu_lead_us`, `cpu_gap_us`, `cpu_tail_us`), a
    CPU-expert policy's pass start and its part before the first mark (`cpu_pass_start_us`,
    `cpu_pass_gap_us`) and the round trip by batch
    (`roundtrip_points`, where two batches or more were measured)."""
    got = {f"cpu_{k}_us": v * 1e6 for k, v in (m.get("cpu_step") or {}).items()}
    if len(m.get("roundtrip_points") or []) > 1:
        got["roundtrip_points"] = tuple((int(b), s * 1e6) for b, s in m["roundtrip_points"])
    return got


def cpu_rows(row, m: dict, p) -> None:
    """`cmoe.calibrate.beside`'s CPU rows: the isolated experts, the in-model ones by tokens and (with
    `cpu_wake_points`) by idle, the round trip and the host around a CPU layer's experts."""
    cpu = m["cpu_expert"]
    for t, s in cpu["points"]:
        row(f"CPU expert, {t} tokens", s, p.cpu_expert_us(cpu["bytes"], t))
    for t, s in (m.get("cpu_expert_in_model") or {}).get("points", []):
        row(f"CPU expert in model, {t} tok", s, p.cpu_expert_us(cpu["bytes"], t))
    for b, kind, s, n in (m.get("cpu_expert_in_model") or {}).get("runs", []):
        row(f"CPU 1 tok, b{b} {kind} run", s, p.cpu_expert_us(cpu["bytes"], 1))
    for t, _, idle, s, n in (m.get("cpu_expert_in_model") or {}).get("idle", []) if p.cpu_wake_points else ():
        if n >= LEAST:
            row(f"CPU expert {t} tok, {idle:.0f}us idle", s, p.cpu_expert_us(cpu["bytes"], t) + p.cpu_wake_us(idle))
    row("round trip", m["roundtrip"], p.roundtrip_us)
    if m.get("roundtrip_in_model"):
        row("round trip in model", m["roundtrip_in_model"], p.roundtrip_us)
    for b, s in m.get("roundtrip_points") or [] if p.roundtrip_points else ():
        row(f"round trip in model, {b} rows", s, p.roundtrip(b))
    for k, s in (m.get("cpu_step") or {}).items():
        name = {"pass_start": "CPU policy, pass start", "pass_gap": "CPU policy, pass gap"}.get(k, f"CPU layer, host {k}")
        row(name, s, getattr(p, f"cpu_{k}_us"))
