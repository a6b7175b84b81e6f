"""What calibrate reads off an executor run's timeline (`RunLog.spans`, `pass_us`): per-layer
means of span kinds and the start-up excess of the pass's first layer, the GPU's idle before a
layer's experts, and the pass's overhead on either side. Pure Python over spans; `measure_model`
runs the executor and `commit_steps` reads commit's own runs."""

from __future__ import annotations

import numpy as np

from cmoe.core.timeline import BYTES, END, LAYER, OP, START, STEP, STREAM


def decode_passes(log) -> set[int]:
    """The run's decode passes (`RunLog.pass_us`: (pass, decode, tokens, us)), which calibrate's
    statistics read; the prefill's start-up is not theirs."""
    return {p for p, d, _, _ in log.pass_us if d}


def _per_layer(log, ops: tuple[str, ...], first: int | None) -> tuple[float, float]:
    """Mean over decode passes of (the `ops` spans' time less the pass's start-up, start-up) in us,
    where the start-up is layer `first`'s excess over the mean of the other layers. Means, not
    medians: throughput pays for the slow passes too. (0, 0) when the run has no such span: the
    engine does that step where the host does not see it (the lean engine's early router inside a
    CUDA graph costs the host nothing; its GPU time lies in `attention`)."""
    per: dict[int, dict[int, float]] = {}
    dec = decode_passes(log)
    for s in log.spans:
        if s[STEP] in dec and s[OP] in ops:
            layer = per.setdefault(s[STEP], {})
            layer[s[LAYER]] = layer.get(s[LAYER], 0.0) + s[END] - s[START]
    if not per:
        return 0.0, 0.0
    tot, st = [], []
    for att in per.values():
        others = [v for k, v in att.items() if k != first]
        start = 0.0 if first is None else max(att[first] - (float(np.mean(others)) if others else 0.0), 0.0)
        st.append(start)
        tot.append(sum(att.values()) - start)
    return float(np.mean(tot)), float(np.mean(st))


def _mean(log, op: str, stat=np.mean) -> float:
    """Mean (or `stat`) duration of the decode passes' `op` spans, in seconds; 0 when the run has
    none (an engine that never does that step pays nothing for it)."""
    dec = decode_passes(log)
    xs = [s[END] - s[START] for s in log.spans if s[STEP] in dec and s[OP] == op]
    return float(stat(xs)) / 1e6 if xs else 0.0


def _gaps(log) -> list[float]:
    """Per decode layer with experts: the GPU's idle time between the end of its attention and the
    start of its first expert, less the host's route and launch spans (seconds), which the
    simulator adds after host_sync_us (the launch less its tail: `_result` adds the tail back).
    With every expert resident it is the read-back's latency once the GPU is done, which the
    host_sync span alone overstates: that span also holds the GPU work the host waited behind."""
    dec = decode_passes(log)
    att, first, route, issue = {}, {}, {}, {}
    for s in log.spans:
        if s[STEP] not in dec:
            continue
        k = (s[STEP], s[LAYER])
        if s[OP] == "attention":
            att[k] = s[END]
        elif s[OP] == "expert":
            first[k] = min(first.get(k, s[START]), s[START])
        elif s[OP] == "host_route":
            route[k] = s[END] - s[START]
        elif s[OP] == "host_expert":
            issue[k] = issue.get(k, 0.0) + s[END] - s[START]
    return [(first[k] - att[k] - route.get(k, 0.0) - issue.get(k, 0.0)) / 1e6 for k in first if k in att]


def _sync_s(host: dict, tail: list) -> float:
    """host_sync_us in seconds: the median gap (`_gaps`) with the launch's tail added back, as the
    simulator charges it (attention's end, + host_sync, + route, + launch - tail = the experts'
    start); without gaps (the reference engine) the host_sync spans' median."""
    if not host["gaps"]:
        return float(np.median(host["sync"]))
    return max(float(np.median(host["gaps"])) + float(np.mean([x for _, x in tail])), 0.0)


def host_marks(log, dec) -> tuple[dict, dict, dict]:
    """One scan of the host lane over the passes `dec`: each pass's `host_head` (start, end), its
    first `host_attention`'s start, and its `host_attention` time by layer, in us."""
    ds = set(dec)
    head: dict[int, tuple[float, float]] = {}
    enter: dict[int, float] = {}
    att: dict[int, dict[int, float]] = {}
    for s in log.spans:
        if s[STEP] not in ds:
            continue
        if s[OP] == "host_head":
            head[s[STEP]] = (s[START], s[END])
        elif s[OP] == "host_attention":
            enter[s[STEP]] = min(enter.get(s[STEP], s[START]), s[START])
            a = att.setdefault(s[STEP], {})
            a[s[LAYER]] = a.get(s[LAYER], 0.0) + s[END] - s[START]
    return head, enter, att


def host_gaps(log, dec: list[int], marks: tuple | None = None) -> list[tuple[int, int, float]]:
    """(pass, next pass, us) for each pair of consecutive passes of `dec` (sorted) with both spans:
    the host lane's gap from the pass's `host_head` end to the next pass's first `host_attention`.
    `marks`: the run's `host_marks`, where the caller has them."""
    head, enter, _ = marks or host_marks(log, dec)
    return [(p, q, enter[q] - head[p][1]) for p, q in zip(dec, dec[1:]) if p in head and q in enter]


def first_excess(layers: dict[int, float]) -> float:
    """A pass's first layer's `host_attention` time over the mean of its other layers' (`host_marks`'
    by-layer times, us); the first's whole time where it has no other."""
    first, *rest = sorted(layers.items())
    return first[1] - (float(np.mean([v for _, v in rest])) if rest else 0.0)


def past_first(layers: dict[int, float]) -> float | None:
    """A pass's host speed: the median of its `host_attention` time by layer (`host_marks`', us)
    past its first layer, which carries the pass's start; None where it has no other layer. The
    same launches in every layer of a run, so it reads the host lane's state in that pass
    (`cmoe.analysis.states`, `cmoe.calibrate.wake.pass_start_samples`)."""
    rest = [v for _, v in sorted(layers.items())[1:]]
    return float(np.median(rest)) if rest else None


def _host_between(log, first: int) -> float:
    """The host's own time from one decode pass's head to the next pass's first layer issued, less
    a layer's (seconds): the gap on the host lane between a `host_head` span and the next pass's
    first `host_attention`, plus layer `first`'s excess. Taken from runs whose host keeps pace with
    the GPU (every layer reads back), so the gap holds the host's books, inputs and replays and no
    wait: with queued decode passes (`pass_overlap`) that, not the GPU's idle, is the pass start
    a host-bound policy pays.

    Calibrate keeps every eager run's figure (`repeats`, "host, pass start") and takes the median of
    all of them, every batch's of every round: on the H100 (twenty-third session) two calibrations'
    20 runs each spread 196-520 us with no trend in the batch, batch 1's four runs alone gave 303
    and 251 us, all twenty 329 and 332; the first round's two batch-1 runs alone (the profile's
    figure before) had read 414, 331 and 289 in three calibrations, against 285-303 in the runs."""
    dec = sorted(p for p, d, _, _ in log.pass_us if d)
    gaps = [g for _, _, g in host_gaps(log, dec)]
    _, start = _per_layer(log, ("host_attention",), first)
    return (max(float(np.mean(gaps)), 0.0) if gaps else 0.0) / 1e6 + start / 1e6


def _pass_overhead(log, first: int) -> tuple[float, float, float]:
    """From a lean `upper` run (the GPU's own timeline, its host ahead; with queued decode passes
    ahead between passes too): (the host's time per pass with the GPU idle: the gap between one
    decode pass's last GPU op and the next one's first, plus layer `first`'s start-up excess; that
    excess alone; the LM head), in seconds."""
    by: dict[int, list[float]] = {}
    for s in log.spans:
        if s[STREAM] == "compute":
            a = by.setdefault(s[STEP], [s[START], s[END]])
            a[0], a[1] = min(a[0], s[START]), max(a[1], s[END])
    dec = sorted(p for p, d, _, _ in log.pass_us if d and p in by)
    gaps = [by[q][0] - by[p][1] for p, q in zip(dec, dec[1:])]
    _, start = _per_layer(log, ("attention",), first)
    gap = float(np.mean(gaps)) if gaps else 0.0
    return (gap + start) / 1e6, start / 1e6, _mean(log, "head")


QUEUE_GAP_US = 3.0     # a load that starts within this of the last one's end was queued behind it


def queued_period(log) -> list | None:
    """The executor's loads queued back to back on the copy stream, from an `ondemand` run's decode
    passes: [bytes, mean seconds from one's end to the next's, count] over the loads that started
    within QUEUE_GAP_US of the previous load's end (the marks between them); None without any.
    What a queued copy costs: no DMA start-up, the gap between the marks included."""
    dec = decode_passes(log)
    loads = sorted((s[START], s[END], s[BYTES]) for s in log.spans if s[STEP] in dec and s[OP] == "load")
    per = [(b, e1 - e0) for (_, e0, _), (s1, e1, b) in zip(loads, loads[1:]) if s1 - e0 < QUEUE_GAP_US]
    if not per or len({b for b, _ in per}) != 1:
        return None
    return [int(per[0][0]), float(np.mean([p for _, p in per])) / 1e6, len(per)]


def load_copies(log) -> list | None:
    """The executor's loads on a CPU, where each is a synchronous copy on the host: [bytes, mean
    seconds a load, count] over an `ondemand` run's decode passes; None without any or with loads of
    more than one size. Means, not medians: throughput pays for the slow copies too."""
    dec = decode_passes(log)
    loads = [(s[BYTES], s[END] - s[START]) for s in log.spans if s[STEP] in dec and s[OP] == "load" and s[BYTES] > 0]
    if not loads or len({b for b, _ in loads}) != 1:
        return None
    return [int(loads[0][0]), float(np.mean([t for _, t in loads])) / 1e6, len(loads)]
