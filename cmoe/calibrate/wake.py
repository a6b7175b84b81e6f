"""The host's route step after a long wait (issue 15): `host_wake_points`.

The validations on the H200 found the loading runs' host 1.3-4x slower per layer than calibration
measured it, and the route step right after a read-back wait slower the longer the wait was
(tenth session: 14.2 us after 50-200 us of waiting, 25.4 after more than 2 ms, at batch 1). A
benchmark (`benchmarks/host_wake_h200.py`, sixteenth session) found the same for any wait, a GPU
spin synced or polled, a copy, a sleep or a host busy loop alike: a fixed host step took 1.04x
after 50 us and 1.39-1.60x after 2-4 ms. So calibration measures it where it matters: the
executor's own route step at batch 1 (ondemand, every expert resident, so the step loads nothing),
after waits made by GPU sleep queued before each layer's experts (`lead_us`), in rounds that
alternate the leads so that a drift of the host's speed falls on all of them alike. A point is
(the mean of the runs' median read-back waits, their mean route step over the unled runs'), the
unled runs' own wait at factor 1. The simulator scales a layer's route step (`host_route`: not the
read-back, the prediction or commit's extra) by the factor at the wait it predicts before it,
over the factor at the wait each batch's route point was measured after (`host_route_waits`, so
a batch whose calibration runs waited longer is not slowed twice; `HardwareProfile.host_wake`). A load's own host cost (`host_load_us`) is not
scaled: calibration prices it in a run that loads, whose waits are long already; scaling it too
double-counted the slowdown (sixteenth session: batch-1 loading rows predicted 1-2% slow).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cmoe.calibrate.spans import decode_passes, first_excess, host_gaps, host_marks, past_first
from cmoe.core.hw_math import held
from cmoe.core.timeline import END, OP, START, STEP, STREAM

WAKE_LEADS_US = (300.0, 1000.0, 3000.0)     # GPU sleep before each layer's experts: waits up to ~3 ms,
                                            # the span of one to two 93.6 MB expert copies at 55 GB/s
WAKE_ROUNDS = 2


def route_and_wait(log) -> tuple[float, float]:
    """(the mean host route step per MoE layer, the median read-back wait), in seconds, over a
    run's decode passes; (0, 0) for a run without them."""
    dec = decode_passes(log)
    route = [s[END] - s[START] for s in log.spans if s[STEP] in dec and s[OP] == "host_route"]
    wait = [s[END] - s[START] for s in log.spans if s[STEP] in dec and s[OP] == "host_sync"]
    if not route or not wait:
        return 0.0, 0.0
    return float(np.mean(route)) / 1e6, float(np.median(wait)) / 1e6


def fit_wake(samples: list[tuple[float, float, float]]) -> list[list[float]]:
    """[[wait s, factor]] from (lead us, route s, median wait s) samples: per lead, the mean wait
    and the mean route over the unled (lead 0) runs' mean route; the unled point at factor 1. Points are
    kept in order of their waits, each past the one before (a lead too short to lengthen the wait
    adds nothing). [] without unled runs or a route to divide by."""
    by: dict[float, list[tuple[float, float]]] = {}
    for lead, route, wait in samples:
        if route > 0:
            by.setdefault(float(lead), []).append((route, wait))
    if 0.0 not in by:
        return []
    base = float(np.mean([r for r, _ in by[0.0]]))
    pts = sorted((float(np.mean([w for _, w in v])), float(np.mean([r for r, _ in v])) / base) for v in by.values())
    out = [[float(np.mean([w for _, w in by[0.0]])), 1.0]]
    for w, f in pts:
        if w > out[-1][0]:
            out.append([w, f])
    return out


def pass_start_samples(log, pairs: tuple | None = None) -> list[list[float]]:
    """Per pair of decode passes p, q = p + 1 (no prefill between): [p's latency, the host lane's
    gap from p's `host_head` end to q's first `host_attention`, the same gap from the later of that
    end and p's last GPU span, q's first layer's `host_attention` excess over its others, p's
    `host_head`, p's loads, p's last read-back wait (its latest `host_sync`), q's host speed (the
    median of its `host_attention` past the first layer: the host lane's state then, fiftieth
    session)], in us (the loads a count). What the pass start (`host_pass_start_us`) takes after a long pass: the validations'
    read-back runs (thirty-fifth session's, pools 16/20) paid 117 us after passes under 20 ms and
    337 after 200-400 ms; the led runs here give passes of ~5-100 ms, their passes synced (a lead
    keeps them from queuing), hence the gap from the GPU's end too. The head is kept to see whether
    it slows alike (the same runs' `host_head` read 33-400 us, calibrated 40). `pairs`: the log's
    `boundary_pairs`, where the caller has them."""
    lat, (head, enter, att), pairs = pairs or boundary_pairs(log)
    gpu_end: dict[int, float] = {}
    loads: dict[int, int] = {}
    wait: dict[int, tuple[float, float]] = {}               # pass -> (start, length) of its last read-back
    for s in log.spans:
        if s[STREAM] == "compute" and s[STEP] in lat:
            gpu_end[s[STEP]] = max(gpu_end.get(s[STEP], s[END]), s[END])
        elif s[OP] == "load":
            loads[s[STEP]] = loads.get(s[STEP], 0) + 1
        elif s[OP] == "host_sync" and s[START] >= wait.get(s[STEP], (-1e30, 0.0))[0]:
            wait[s[STEP]] = (s[START], s[END] - s[START])
    return [[float(lat[p]), gap, enter[q] - max(head[p][1], gpu_end.get(p, head[p][1])), first_excess(att[q]),
             head[p][1] - head[p][0], float(loads.get(p, 0)), wait.get(p, (0.0, 0.0))[1],
             past_first(att[q])]
            for p, q, gap in pairs]


def boundary_pairs(log) -> tuple[dict, tuple, list[tuple[int, int, float]]]:
    """A log's decode passes ({pass: latency us}), their `host_marks`, and the pairs a pass boundary
    is read from: (p, q = p + 1, the host lane's gap from p's `host_head` end to q's first
    `host_attention`) where q has two layers or more: `pass_start_samples`' rows in its order, and
    what `cmoe.analysis.boundary.boundary_rows` pairs with them."""
    lat = {p: us for p, d, _, us in log.pass_us if d}
    order = sorted(lat)
    marks = host_marks(log, order)
    return lat, marks, [(p, q, gap) for p, q, gap in host_gaps(log, order, marks) if q == p + 1 and len(marks[2][q]) > 1]


def pass_start_means(starts: list) -> dict[float, tuple[float, float]]:
    """lead us -> (mean previous pass us, mean pass start us) of `measure`'s "pass_start_samples",
    over the lead's runs' medians. A pair's start: the host from the later of its head and the
    GPU's end to the next pass's first layer, plus that layer's excess; from its head alone where
    the host entered the next pass before the GPU ended (queued passes: the unled runs')."""
    by: dict[float, list] = {}
    for lead, pairs in starts:
        if pairs:
            a = np.array(pairs, np.float64)
            start = np.where(a[:, 2] >= 0.0, a[:, 2], a[:, 1]) + a[:, 3]
            by.setdefault(float(lead), []).append((float(np.median(a[:, 0])), float(np.median(start))))
    return {lead: (float(np.mean([p for p, _ in v])), float(np.mean([s for _, s in v]))) for lead, v in sorted(by.items())}


class LoadingBoundary(NamedTuple):
    """`loading_boundary`'s medians, in us: the previous pass, the head, the pass start, the loads a
    pass and the last read-back wait (both NaN in older samples), head plus start (the median of
    each pair's sum, as `cmoe.analysis.boundary.boundary_price` reads a validation's runs), and the
    next pass's host time per MoE layer (NaN in samples from before the fiftieth session): kept so
    that a later reading can tell the host lane's state the boundary was read in; nothing prices
    it yet (it is read after milliseconds-long waits, so not against `host_layer`, whose steps wait
    little, and per MoE layer, where `host_layer` is per decoder layer)."""
    prev_us: float
    head_us: float
    start_us: float
    loads: float
    wait_us: float
    total_us: float
    host_us: float


def loading_boundary(pairs: list) -> LoadingBoundary | None:
    """The medians (`LoadingBoundary`) of `pass_start_samples` over
    a run that loads (calibrate's ondemand with top_k slots: every layer loads; up to top_k times
    the layers a pass, so on the 4-layer cut at most 8 for Mixtral, and the built model's runs are
    the ones that reach the validations' dozens), the start read as `host_pass_start_us` and
    `benchmarks/boundary_by_wait.py` read it: the gap from the head plus the next first layer's
    excess (the host's own time; not the GPU-sleep runs' reading, which waits for the GPU's end);
    None without pairs. `fit_boundary` prices what it takes over the quiet boundary."""
    if not pairs:
        return None
    a = np.array(pairs, np.float64)
    loads, wait, host = (float(np.median(a[:, k])) if a.shape[1] > k else float("nan") for k in (5, 6, 7))
    start = a[:, 1] + a[:, 3]
    return LoadingBoundary(float(np.median(a[:, 0])), float(np.median(a[:, 4])), float(np.median(start)), loads, wait,
                           float(np.median(a[:, 4] + start)), host)


def fit_boundary(pairs: list, price, wake_points: tuple) -> list[list[float]]:
    """`host_boundary_points` [[last read-back wait us, extra us]] from calibrate's loading run
    (`loading_pass_start_samples`): what its boundary (head plus next start, medians) took over
    `price(previous pass us)`, the profile's price without it, at the run's median last wait, read
    down to nothing along the route step's slow-down after waits (`host_wake_points`, (us, factor):
    each wait's factor less one over the loading wait's), or a line from (0, 0) without one (or
    without a point below the loading wait). []
    without samples that carry the wait, or where the loading boundary took no longer.
    Why: on an H100 (forty-fifth session) the validations' loading runs took 148-169 us of head
    and start where a pass loaded 1-4 experts and 1.1-1.9x the model's price where it loaded 9 or
    more, after last waits of 1-5 ms; calibrate's GPU-sleep runs, waiting as long without loads,
    kept their head at 21-35 us. The route step's own wake (`fit_wake`) steps between the same
    waits, ~140 and ~400 us, which is the shape used here."""
    got = loading_boundary(pairs)
    if got is None:
        return []
    wait = got.wait_us
    extra = got.total_us - price(got.prev_us)
    if not (extra > 0.0 and wait > 0.0):                 # NaN: samples from before the wait was kept
        return []
    top = held(wake_points, wait, 1.0)
    ramp = [[float(w), extra * min(max((f - 1.0) / (top - 1.0), 0.0), 1.0)] for w, f in wake_points
            if w < wait] if top > 1.0 else []
    return (ramp or [[0.0, 0.0]]) + [[wait, extra]]


def fit_pass_start(starts: list) -> list[list[float]]:
    """`host_pass_start_points` [[previous pass us, extra us]] from `measure`'s samples: each
    lead's mean start less the unled runs' (clamped at 0), at its mean previous pass; the unled
    point at 0, each point past the one before. [] without unled runs. Thirty-sixth session, two
    H100 hosts: the first's 102 us after 5.1 ms passes, 128 after 15.6, 190 after 38.7 and 264
    after 104, most of it its sampler thread's stall (`cmoe.calibrate.host_load`: one sample a
    0.1 s, held off to a pass's end), its read-back runs paying 112-351 us; the second's, sampled
    from a child process, 136, 254, 303 and 314, its runs 186-606 (BENCHMARKS.md)."""
    means = pass_start_means(starts)
    if 0.0 not in means:
        return []
    base_pass, base = means[0.0]
    out = [[base_pass, 0.0]]
    for prev, start in sorted(means.values()):
        if prev > out[-1][0]:
            out.append([prev, max(start - base, 0.0)])
    return out


def measure(r) -> dict:
    """{"wake_points": `fit_wake`'s, "wake_samples": [[lead us, route s, wait s]], "pass_start_samples":
    [[lead us, `pass_start_samples`]] (`host_fit` fits them: `fit_pass_start`)} of
    `cmoe.calibrate.measure_model._ModelRuns` r (CUDA only: GPU sleep is how the waits are made):
    WAKE_ROUNDS rounds of ondemand at batch 1, every expert resident, one run per lead (0 and
    WAKE_LEADS_US) in a round, after one untimed run."""
    from dataclasses import replace

    from cmoe.executor.run import run_policy
    w, hc = r.host_work[1]
    run_policy(w, hc, "ondemand")
    samples, starts = [], []
    for _ in range(WAKE_ROUNDS):
        for lead in (0.0, *WAKE_LEADS_US):
            log = run_policy(w, replace(hc, lead_us=lead), "ondemand").log
            route, wait = route_and_wait(log)
            samples.append((lead, route, wait))
            starts.append([lead, pass_start_samples(log)])
    return {"wake_points": fit_wake(samples), "wake_samples": [list(x) for x in samples], "pass_start_samples": starts}
