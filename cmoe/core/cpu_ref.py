"""The host CPU's plain speed: a fixed pure-Python loop, timed where calibrate measures the host
costs and around every executor run, so that a run whose host ran slower than its calibration can
say whether the CPU itself was slower then (a tenant, its clock) or only the executor's host work.

Why (BENCHMARKS.md, fifty-second session): on an H100 the host lane's slow state (its
`host_attention` ~2x, its pass boundary 446-674 us against 133-156) followed this loop timed
right after each run (r 0.93 over 16 runs; the loop 1.84-2.29 ms after the runs 85% slow or more,
1.11-1.19 ms after those under 40%), and only loosely the same loop timed before it (r 0.47):
the state changes within a second. The fifty-first session, timing before each run only, found
no link (r 0.11).

Pure Python on purpose: no torch, no driver, nothing the executor's own state changes.
"""

from __future__ import annotations

import statistics
import time

LOOP_N = 20_000          # ~1.1-2.4 ms on an H100 host's core (fifty-first and fifty-second sessions)
REPS = 5


def cpu_ref_us(n: int = LOOP_N, reps: int = REPS) -> float:
    """The loop's time, us: the median of `reps` timings of `n` steps of integer work."""
    took = []
    for _ in range(reps):
        t, s = time.perf_counter(), 0
        for i in range(n):
            s += i ^ (i >> 3)
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e6


def cpu_ref_ratio(runs, profile) -> float | None:
    """A run's loop time (its readings, before and after: their mean) over its calibration's
    (`profile`): above 1, the CPU ran slower than when the host costs were measured. None where
    either side was not recorded (a profile from before, a simulated run, a stored run folder)."""
    got = [float(x) for x in (runs or ()) if x]
    if not got or not profile:
        return None
    return statistics.fmean(got) / float(profile)


def cpu_ref_note(ratios: list[float | None]) -> str | None:
    """The line `cmoe run` says of its runs' `cpu_ref_ratio`s where any was recorded: their range."""
    got = [r for r in ratios if r is not None]
    if not got:
        return None
    lo, hi = min(got), max(got)
    span = f"{lo:.2f}x" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}x"
    return f"the host CPU's plain loop (`cmoe.core.cpu_ref`) took {span} its calibrated time around the runs"


def validation_ratio(v: dict) -> float | None:
    """`cpu_ref_ratio` of a `cmoe validate` result (its "cpu_ref_us": profile's and the run's)."""
    refs = v.get("cpu_ref_us") or {}
    return cpu_ref_ratio(refs.get("runs"), refs.get("profile"))


def cpu_ref_line(v: dict) -> str | None:
    """`format_validation`'s line for the loop, where both sides recorded it."""
    if (k := validation_ratio(v)) is None:
        return None
    runs = " and ".join(f"{x:.0f}" for x in v["cpu_ref_us"]["runs"])
    return (f"  the host CPU's plain loop took {runs} us before and after the run, {k:.2f}x its "
            f"{v['cpu_ref_us']['profile']:.0f} us at calibration (cmoe.core.cpu_ref)")
