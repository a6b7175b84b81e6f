"""A decoder layer's non-expert time from calibration's measurements (`cmoe.calibrate.profile_fit`
fits the rest): a line over the batch's tokens, attention's cost per key from a short and a long
context, and, where the lean engine's decode attention cuts each head's keys into runs sized by the
cache (`kernels_triton.attention.splits`), what each run past the first costs.

Why the runs: on the H200 (nineteenth session) `upper`'s layers took 47.7 us in runs whose cache
held 320 slots (prompt 64, 256 decode steps: 5 runs) against 45.2 in calibration's own, whose cache
held 52 (one run), and the simulator put them at 45.7, which priced attention by keys alone. The
kernel pays for the cache's empty runs too (9.6 against 5.5 us at 65 keys of 2,112 slots,
sixteenth session). So calibration times a third run, the short prompt in a cache as long as the
long-context run's, and the three points fix t = a + k keys + r (runs - 1).

Limits: r is measured at batch 1 and charged alike at every batch, though the kernel launches
batch x kv heads x runs programs; k is measured at the long cache's runs and charged at every count.
"""

from __future__ import annotations

from cmoe.calibrate.link_fit import fit_line
from cmoe.core.hw import GB, split_runs


def layer_fit(m: dict, hbm: float) -> tuple[float, float, float, dict]:
    """A decoder layer's non-expert time: (seconds at one token less its weight reads and the
    short runs' keys, seconds per extra token, seconds per key attended, and where the attention
    cuts its keys into runs sized by the cache the profile's fields for that, `split_fit`)."""
    la, lb = fit_line([(t - 1, s) for t, s in m["layer"]["points"]])
    la -= m["layer"].get("resident_bytes", 0) / (hbm * GB)          # the profile adds weight reads itself
    ctx = m["layer"].get("context_points")                          # [(mean keys per token, seconds per layer)]
    per_key, split = 0.0, {}
    if ctx and ctx[1][0] > ctx[0][0]:
        per_key = max((ctx[1][1] - ctx[0][1]) / (ctx[1][0] - ctx[0][0]), 0.0)
        if (got := split_fit(m, ctx)) is not None:
            per_key, split = got
        la -= per_key * ctx[0][0]                                   # the short runs' keys, now priced per key
    return la, lb, per_key, split


def split_fit(m: dict, ctx: list):
    """(seconds per key, profile fields) of t = a + k keys + r (runs - 1) through the two context
    points and the split point (a short prompt in the long run's cache), each at the runs its cache
    gives (`split_runs`); None without that point or a kernel that splits, or where the three
    points do not fix it (the short runs' cache must be one run, the two long ones' alike)."""
    sp, caches, most = m["layer"].get("split_point"), m["layer"].get("context_caches"), m.get("attn_split_max", 0)
    if not (sp and caches and most):
        return None
    block = m.get("attn_split_block", 64)
    runs = [split_runs(c, most, block) for c in (*caches, sp[2])]
    (k0, t0), (k1, t1), (k2, t2) = *ctx, sp[:2]
    if runs[0] != 1 or runs[1] != runs[2] or runs[2] < 2 or k1 == k2:
        return None
    k = max((t1 - t2) / (k1 - k2), 0.0)                             # the two long caches: keys alone differ
    r = max((t2 - t0 - k * (k2 - k0)) / (runs[2] - 1), 0.0)         # the short cache against the long one
    return k, {"attn_us_per_split_run": r * 1e6, "attn_split_max": int(most), "attn_split_block": int(block)}
