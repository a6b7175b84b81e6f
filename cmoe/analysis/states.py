"""Two speeds in one run: a measured quantity that splits into a fast and a slow group, and the
share of the slow one. A calibration prices one state, so a validation that names the other
reads a miss as the machine's, not the model's.

- the CPU experts (`cmoe.analysis.validate.slow_cpu`): on the lent GPUs' hosts a run's CPU
  experts ran at ~1.0-1.2 or ~1.6-2.0 ms a one-token expert, switching within runs (thirtieth
  session);
- the host lane (`slow_host`): on the lent H100s (forty-eighth and forty-ninth sessions) the
  issuing thread ran its layers' launches at ~2.2-2.7 us for tens of passes, then at ~5,
  everything on it slowing together, the pass boundary from ~200 us to ~550; it held for seconds
  to minutes, in both arms of an A/B alike, whether the thread was pinned to one core or not
  (`benchmarks/affinity_probe.py`). A run that spent part of its passes there made ~3% fewer
  tokens/s (82.8-83.4 against 85.5-86.3 for `lru-prefetch` at pool 26).

Numpy only, as `cmoe.analysis.validate` is.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from cmoe.calibrate.spans import host_marks, past_first

SLOW_FACTOR = 1.3   # two groups this far apart: two states
SLOW_SHARE = 0.1    # ... the smaller at least this share of the values, named by `format_validation`
SEPARATION = 0.8    # ... and their split this much of the log values' variance: one wide state splits at ~0.64
MIN_VALUES = 8      # fewer values than this say nothing


def two_states(values) -> tuple[dict, np.ndarray] | None:
    """Positive `values` split in two groups where their log splits best (Otsu's threshold: the most
    variance between the groups, each at least `SLOW_SHARE` of them and two values, the outer 2% at
    each end pulled in first so that a tail of outliers cannot make a group): ({"share": the slower
    group's share, "factor": its median over the faster's, "separation": the variance between the
    groups over the whole's}, a mask of the slower group's values). The share is 0 and the mask
    empty where the groups are under `SLOW_FACTOR` apart or split under `SEPARATION` of the
    variance: one state, however slow (a run slow throughout shows in its mean) or wide (the best
    split of one normal state takes 2/pi of its variance, ~0.64, and puts its halves' medians
    exp(1.35 sigma) apart: 1.3x at a sigma of 0.19). None under `MIN_VALUES` values, or where one
    is not a finite positive number."""
    v = np.asarray(values, float)
    if v.size < MIN_VALUES or not (np.isfinite(v) & (v > 0)).all():
        return None
    lv = np.log(v)
    order = np.argsort(lv, kind="stable")
    x = lv[order]
    x = np.clip(x, *np.percentile(x, [2, 98]))
    n, c = x.size, np.cumsum(x)
    least = max(math.ceil(SLOW_SHARE * n), 2)
    i = np.arange(least, n - least + 1)
    lo, hi = c[i - 1] / i, (c[-1] - c[i - 1]) / (n - i)      # the first i in the faster group
    between = i * (n - i) * (hi - lo) ** 2
    k = int(i[np.argmax(between)])
    factor = float(np.exp(np.median(x[k:]) - np.median(x[:k])))
    total = float(((x - x.mean()) ** 2).sum()) * n
    sep = float(between.max() / total) if total > 0 else 0.0
    slow = np.zeros(n, bool)
    if factor >= SLOW_FACTOR and sep >= SEPARATION:
        slow[order[k:]] = True
    return {"share": float(slow.mean()), "factor": factor, "separation": sep}, slow


def pass_host_us(spans, steps: set[int]) -> dict[int, float]:
    """Per pass of `steps`: its host speed (`cmoe.calibrate.spans.past_first`: the median of its
    `host_attention` time by layer past the first layer, whose spans carry the pass's start;
    `commit` writes two there), us. Passes without a layer past the first, or whose speed is not a
    finite positive time, are left out."""
    _, _, att = host_marks(SimpleNamespace(spans=spans), steps)
    got = {p: past_first(att[p]) for p in sorted(att)}
    return {p: v for p, v in got.items() if v is not None and math.isfinite(v) and v > 0}


def slow_host(spans, steps: set[int], pred: dict[int, dict], meas: dict[int, dict]) -> dict | None:
    """The measured run's host lane in two states (`two_states` of `pass_host_us`): the slower
    group's share of the passes and `factor`, and, where there is one, its passes (`slow_passes`)
    and `fast_error`: the predicted tokens/s against the measured over the other passes alone (`pred`, `meas`: pass -> its
    {"tokens", "us"}). None without a host lane of `MIN_VALUES` passes (a simulated run, `upper`
    on some engines)."""
    host = pass_host_us(spans, steps)
    got = two_states(list(host.values()))
    if got is None:
        return None
    out, slow = got
    if out["share"] > 0:
        out["slow_passes"] = [p for p, s in zip(host, slow) if s]
        fast = [p for p, s in zip(host, slow) if not s]
        tp = sum(pred[p]["tokens"] for p in fast) / sum(pred[p]["us"] for p in fast)
        tm = sum(meas[p]["tokens"] for p in fast) / sum(meas[p]["us"] for p in fast)
        out["fast_error"] = (tp - tm) / tm
    return out


def host_line(v: dict) -> str | None:
    """`format_validation`'s line where a validation's host ran in two states (`slow_host`)."""
    sh = v.get("slow_host") or {}
    if sh.get("share", 0.0) < SLOW_SHARE:
        return None
    return (f"  the host lane ran {sh['factor']:.2f}x slower in {sh['share']:.0%} of the passes than in the rest, "
            f"a state of the machine no profile prices; over the other passes end to end "
            f"{sh['fast_error'] * 100:+.1f}%; repeat the runs (cmoe run --repeat N) to see it")


def states_note(vs: list[dict]) -> str | None:
    """The line `cmoe run` says of its validations `vs` (every run of every policy) where a run's
    host lane ran in two states (`slow_host`): how many of the runs with a host lane, how far apart
    and how much of them slow, and their errors over their fast passes alone."""
    read = [v["slow_host"] for v in vs if v.get("slow_host")]
    two = [s for s in read if s.get("share", 0.0) >= SLOW_SHARE]
    if not two:
        return None
    span = lambda xs, f: f(min(xs)) if min(xs) == max(xs) else f"{f(min(xs))} to {f(max(xs))}"  # noqa: E731
    return (f"the host lane ran in two states in {len(two)} of {len(read)} runs (the slow one "
            f"{span([s['factor'] for s in two], '{:.2f}x'.format)}, {span([s['share'] for s in two], '{:.0%}'.format)} "
            f"of their passes); over their other passes alone the errors were "
            f"{span([s['fast_error'] for s in two], lambda e: f'{e * 100:+.1f}%')}")
