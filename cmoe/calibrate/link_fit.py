"""The link's bandwidth curve from `cmoe calibrate`'s timed copies: the best of each size's
repeats, the sizes from LINE_FROM up on one line through the smallest copy and the median of the
largest copy's rounds, moved to calibrate's own queued expert loads where those ran faster
(`queued_fit`), or on a CPU to the executor's own loads in the model (`copied_fit`); and
`fit_line`, the least-squares line the other fits use. Pure arithmetic, no torch."""

from __future__ import annotations

import math

import numpy as np

from cmoe.core.hw import GB, HardwareProfile

Points = list[tuple[float, float]]


def best_per_size(points: Points) -> list[tuple[int, float]]:
    """The fastest of the repeats at each size, ascending by size."""
    best: dict[int, float] = {}
    for b, s in points:
        best[int(b)] = min(best.get(int(b), math.inf), s)
    return sorted(best.items())


LINE_FROM = 16 * 2**20     # copies from this size up are fitted as one line (`curve`)


def curve(points: Points, top_rounds: list[float] | None = None) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) copies -> ascending (bytes, GB/s) points.

    From LINE_FROM up the points lie on one line, t = latency + bytes / bandwidth, through the
    smallest and the largest copy's best times, the two measurements least mixed with the other
    term (the smallest is nearly all latency, the largest nearly all bandwidth). Each large size's
    own best is not kept, because an expert's copy (~91 MB for Mixtral) falls between two
    measured sizes and one slow size moved it: on the H200 (sixth session) one calibration's 64 MiB copy
    ran at 50.4 GB/s between 51.1 at 16 MiB and 54.0 at 256 MiB, and the interpolated expert copy
    came to 1,826 us where that machine's runs measured a median of 1,709 (the line: 1,756; the
    session's other calibration: 1,709 by the line, 1,701 interpolated, 1,694 measured).

    `top_rounds`: the largest copy's best in later rounds of the calibration; the line goes through
    the median of every round's best. The link drifts in spells of seconds (the H200, tenth session:
    loads at 49-55.4 GB/s within one run, the largest copy's best 54.1 GB/s in one calibration and
    55.4 in the one a minute before it), and a spell outlasts a round's nine back-to-back repeats,
    which then all see it: rounds spread over the calibration see the link's usual state."""
    best = best_per_size(points)
    (b0, t0), (bn, tn) = (best[0], best[-1]) if best else ((0, 0.0), (0, 0.0))
    if top_rounds and best:
        tn = float(np.median([tn, *top_rounds]))
        best[-1] = (bn, tn)
    if bn >= LINE_FROM and bn > b0 and tn > t0:
        per_byte = (tn - t0) / (bn - b0)
        lat = t0 - b0 * per_byte
        best = [(b, s) if b < LINE_FROM else (b, lat + per_byte * b) for b, s in best]
    return tuple((b, b / s / GB) for b, s in best)


def fit_line(points: Points, weights: list[float] | None = None) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x (each point counted `weights` times)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = np.ones_like(x) if weights is None else np.array(weights, dtype=float)
    if len(points) == 1 or np.ptp(x) == 0:
        return float(np.average(y, weights=w)), 0.0
    b, a = np.polyfit(x, y, 1, w=np.sqrt(w))
    return float(a), float(b)


def queued_fit(load_queue, h2d: tuple) -> tuple[tuple, dict, float]:
    """The H2D curve and `h2d_queued_us` from calibrate's queued loads ([bytes, mean seconds a load,
    count], `spans.queued_period`): what a queued load takes beyond its bytes at the curve's last
    rate, and how much faster than `h2d` the curve now runs: (h2d, {}, 1.0) where none was measured;
    no start-up (0) where they ran faster than that rate.

    Loads of LINE_FROM bytes or more that ran faster than the curve's last rate move the curve's
    line instead (its points from LINE_FROM up, k times as fast), so that the profile prices such a
    load (`h2d_queued`, which then reads the curve) at what calibrate's took; the smaller copies'
    points, mostly start-up, stay as measured. Those loads are the store's own pinned experts on
    the executor's copy stream, what the runs copy; the curve's largest copy is another buffer,
    timed at other moments. On the H100 of the twenty-sixth session (47523d2) the largest copy's
    rounds spread 17% (4.86-5.71 ms for 256 MiB) and their median put the line at 53.4 GB/s;
    calibrate's 112 queued expert loads (93.6 MB) ran at 54.8, and the validation's loads at a
    median 1.038x the curve (31 of 60 rows within 3%). In the twelve other stored Mixtral
    calibrations with queued loads, the loads' own rate was within 1% of their runs' in eleven.
    Smaller loads (OLMoE's 3 MB) are mostly start-up: their rate says little of the line's, and
    moves nothing. Slower loads keep the line and price their excess as start-up, which
    `h2d_queued` never lets above the curve's own time: a load slower than that is priced at it
    (fa7b3d0's call: 1,706 us for 1,715 measured). Calibrate's sizes (64 KiB to 256 MiB by 4x)
    hold a point at 16 MiB, so the moved line's interval and the kept points' never mix; copies
    between 4 and 16 MiB take part of the move."""
    if not load_queue or load_queue[1] <= 0:
        return h2d, {}, 1.0
    nbytes, seconds, _ = load_queue
    at_last = nbytes / (h2d[-1][1] * GB)
    if nbytes >= LINE_FROM and h2d[-1][0] >= LINE_FROM and seconds <= at_last:
        k = nbytes / (HardwareProfile.curve_gbps(h2d, nbytes) * GB) / seconds   # the curve's own time over theirs
        return tuple((b, g * k if b >= LINE_FROM else g) for b, g in h2d), {"h2d_queued_us": 0.0}, k
    return h2d, {"h2d_queued_us": max(seconds - at_last, 0.0) * 1e6}, 1.0


def copied_fit(load_copy, h2d: tuple) -> tuple[tuple, float]:
    """On a CPU, the H2D curve priced at calibrate's own expert loads in the model ([bytes, mean
    seconds, count], `spans.load_copies`): every point k times as fast, k the curve's time for those
    bytes over theirs; (h2d, 1.0) where none was measured.

    Why: there the "link" is the host copying a store's bytes into a pool slot between other work,
    and `measure.copies` times the same two buffers back to back. On the forty-fourth session's AMD
    EPYC (2 cores) the embedded model's 52,224-byte loads took 12.4-12.9 us a load (mean) in
    calibrate's `ondemand`, against 4.2 us on the curve, and every `cmoe run`'s summary said its
    loads moved at 0.25-0.36x the calibrated link and blamed the machine's noise. Timed alone
    (`benchmarks/cpu_copy_after_work.py`, five runs, one thread or two, medians), a 52,224-byte
    `copy_` took 1.7-4.0 us right after the same copy, 4.5-7.0 from a new place in a 64 MiB
    buffer, and 4.7-27 after 2 ms of the host spinning in Python: what the copy follows, not only
    where its bytes lie, sets its time, and that moves with the machine's state. The excess grows
    with the copy (1 MiB: 17-35 us right after itself, 46-74 after the host's work; 8 MiB: 269-501
    against 402-653), while the ratio shrinks (2.0-9.5x at 52 KB, 1.9-2.8x at 1 MiB, 1.1-1.8x at
    8 MiB): one factor is right at the size it was measured at, neither a factor nor a start-up at
    the others. A CPU profile serves the model it was calibrated on (`cmoe run` calibrates afresh),
    so the whole curve scales and the source names the size; priced for experts of another size,
    its loads come out slow. In two of the three runs loads issued ahead of their layer (`oracle`,
    `commit`, `adaptive`) took means of 18.8-21.3 us against `ondemand`'s 12.5-16.5 (in the third,
    `oracle`'s 12.5 against 14.5), which this single figure does not separate."""
    if not load_copy or load_copy[1] <= 0:
        return h2d, 1.0
    nbytes, seconds, _ = load_copy
    k = nbytes / (HardwareProfile.curve_gbps(h2d, nbytes) * GB) / seconds
    return tuple((b, g * k) for b, g in h2d), k
