"""What calibrate reads off commit's own runs on the lean engine: its pass's start (layer 0's
prediction read back and planned before the layer runs: `start_excess_s`), and its step between a
layer's attention and its launch on the compute stream (the `route` span: the read-back's start and the
launch's inputs, candidates and slot table, copied there), when no copy moves on the link and
when one does (the inputs' small copies then wait behind the load's on the one H2D engine: on the
H200 15.6 us against 42 us, every batch and pool of the e70ed54 validation)."""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.spans import decode_passes
from cmoe.core.timeline import END, LAYER, OP, START, STEP, STREAM

SLOW_MIN = 5     # spans on each side (a load in flight at its start, none) for a copy slowdown
START_MIN = 3    # passes on each side for `start_copy_s` (a pass gives one layer-0 span)


def route_gpu_s(log, first: int) -> tuple[float, float]:
    """(median route span with no load moving as it starts, median with one moving), in seconds,
    over commit's decode layers (its ahead path issues no loads inside the span) but the first (the
    pass's start-up); 0 where there is none. The medians: the GPU's own time where the host is
    ahead, as it mostly is on this path."""
    moving = _in_flight(log)
    quiet, busy = [], []
    for s in _routes(log, first):
        (busy if moving(s[START]) else quiet).append(s[END] - s[START])
    return tuple(float(np.median(xs)) / 1e6 if xs else 0.0 for xs in (quiet, busy))


def readback_copy_s(log, first: int, moe_layers) -> float | None:
    """What a read-back policy's route span (the compute stream from its attention's end to the
    experts' launch) takes more when a load is moving as it starts, in seconds, from a run with its
    plans recorded: busy median less quiet median within each count of loads the layer's own plan
    issued (the host issues them inside the span: `host_load_us` each, priced apart), weighted by
    the spans of each; None where no count has `SLOW_MIN` of each side. Where the layers that issued
    none have them, from those alone: on the H200 (2026-12-05) their route span took 11-14 us quiet
    and 25-32 beside a load in the pool-26 read-back runs, while one that issued a load took 23-29 us
    either way (seen, not explained), so pooling the counts read 6.5 us."""
    moving = _in_flight(log)
    own = {(r.pass_index, moe_layers[r.layer]): len(r.loads) for r in log.plans if r.layer >= 0}
    by: dict[int, dict[bool, list]] = {}
    for s in _routes(log, first):
        if (s[STEP], s[LAYER]) in own:
            by.setdefault(own[s[STEP], s[LAYER]], {True: [], False: []})[moving(s[START])].append(s[END] - s[START])
    d = _weighted([by.get(0, {True: [], False: []})], lambda busy, quiet: busy - quiet)
    if d is None:
        d = _weighted(list(by.values()), lambda busy, quiet: busy - quiet)
    return d / 1e6 if d is not None else None


def launch_copy_s(log, first: int, moe_layers) -> float | None:
    """What a read-back policy's launch of its experts waits more when a load is moving as the host
    issues it, in seconds, from a run with its plans recorded: the compute stream's gap from the
    route span's end (the launch issued) to the layer's first expert, busy median less quiet median,
    over the decode layers but the first whose plan loaded nothing into the layer itself and none of
    whose own loads, moving or queued, landed after the route's end and began before the experts (a
    wait for its own copy is not this one). The gap is the slot table's small copy
    (`lean_io._set_table`, on the compute stream) and the launch: on the H200 (2026-12-05), medians,
    6 us with the link idle and 16-25 beside a load in the read-back policies' runs at batches 1 and
    2. None where either side has under `SLOW_MIN`."""
    moving = _in_flight(log)
    own = {(r.pass_index, moe_layers[r.layer]) for r in log.plans
           if r.layer >= 0 and not any(ld[0] == r.layer for ld in r.loads)}
    landing: dict[int, list] = {}
    first_x: dict[tuple, float] = {}
    for s in log.spans:
        if s[OP] == "load" and s[END] > s[START]:
            landing.setdefault(s[LAYER], []).append((s[START], s[END]))
        elif s[OP] == "expert":
            k = (s[STEP], s[LAYER])
            first_x[k] = min(first_x.get(k, s[START]), s[START])
    gaps: dict[bool, list] = {True: [], False: []}
    for s in _routes(log, first):
        k, t = (s[STEP], s[LAYER]), s[END]
        if k in own and k in first_x and not any(b > t and a < first_x[k] for a, b in landing.get(s[LAYER], ())):
            gaps[moving(t)].append(first_x[k] - t)
    d = _weighted([gaps], lambda busy, quiet: busy - quiet)
    return d / 1e6 if d is not None else None


def commit_gpu_s(resident_log, loading_log, first: int) -> tuple[float, float]:
    """(`commit_gpu_s`, `commit_gpu_copy_s`): the route step with every expert resident, and what
    it takes more while a load moves (a run that loads: fewer slots than experts)."""
    quiet, _ = route_gpu_s(resident_log, first)
    _, busy = route_gpu_s(loading_log, first)
    return quiet, (max(busy - quiet, 0.0) if busy else 0.0)


def copy_slowdowns(log, first: int) -> dict:
    """What a load in flight does to the model's own kernels, from a run that loads while it
    computes, over the decode passes and the layers but `first` (its start-up); per op, the
    slowdown (less 1) of the work that started while a load was on the link over the work that
    did not, None where either side has under `SLOW_MIN`:
    - "attention": each attention span from the later of its start and the host's launch of it
      (the end of its `host_attention`: a GPU that waited for the host did not run slower), medians;
    - "expert": each fused launch (a layer's expert spans that abut: one launch split evenly), by
      its own start, medians within each expert count, weighted by the launches of each.
    On an H100 (twenty-third session) every loading run of three calls read 0.11-0.14 for the
    attention step (the host had launched it before the GPU got there in all but 4 of 992 spans a
    run) and 0.06-0.11 for the experts, where a lone HBM-bound copy beside a load slowed 1.5-3.6%
    and a matmul about 1%: a proxy kernel does not say what decode's small launches lose."""
    att = attention_tails(log, lambda layer: layer != first, _in_flight(log))
    ratio = lambda busy, quiet: busy / quiet - 1.0  # noqa: E731
    return {"attention": _weighted([att], ratio), "expert": _weighted(list(launches_by_size(log, first).values()), ratio)}


def launch_copy_points(log, first: int, batch: int) -> list[list]:
    """Calibrate's points for `copy_launch_us` from a loading run at `batch` (`launch_points` of its
    `launches_by_size`, in seconds: the log's spans are in us)."""
    return launch_points(launches_by_size(log, first), batch, 1e6)


def launch_points(groups: dict[int, dict[bool, list]], batch: int, per: float = 1.0) -> list[list]:
    """Per count of experts in a fused launch with `SLOW_MIN` launches on each side of `groups`
    (`launches_by_size`, one run's or several pooled), [batch, count, quiet median, busy median
    (the groups' unit over `per`), quiet launches, busy launches]."""
    return [[batch, n, float(np.median(g[False])) / per, float(np.median(g[True])) / per, len(g[False]), len(g[True])]
            for n, g in sorted(groups.items()) if len(g[True]) >= SLOW_MIN and len(g[False]) >= SLOW_MIN]


def launches_by_size(log, first: int) -> dict[int, dict[bool, list]]:
    """The decode passes' fused expert launches (a layer's expert spans that abut) of every layer but
    `first`, by how many experts each holds: {True: durations of those that started while a load was
    on the link, False: the others}, in the log's units. What a load does to them is read here
    (`copy_slowdowns`, and `benchmarks/copy_beside_launch.py` on a validation's runs)."""
    dec, moving = decode_passes(log), _in_flight(log)
    pieces: dict[tuple, list] = {}
    for s in log.spans:
        if s[STEP] in dec and s[STREAM] == "compute" and s[LAYER] != first and s[OP] == "expert":
            pieces.setdefault((s[STEP], s[LAYER]), []).append((s[START], s[END]))
    by_n: dict[int, dict[bool, list]] = {}
    for ps in pieces.values():
        ps.sort()
        run = [ps[0]]
        for a, b in ps[1:] + [(None, None)]:
            if a is not None and abs(a - run[-1][1]) < 1e-3:
                run.append((a, b))
                continue
            by_n.setdefault(len(run), {True: [], False: []})[moving(run[0][0])].append(run[-1][1] - run[0][0])
            run = [(a, b)]
    return by_n


def start_copy_s(log, first: int, quiet=None) -> float | None:
    """What a queued pass's GPU start-up takes more when a load is moving as it begins
    (`start_copy_us`), in seconds, from a run whose loads go out ahead of their pass (oracle):
    layer `first`'s attention tail (`attention_tails`; the executor's first span of a pass, which
    holds its inputs and start-up, and a dense first decoder layer's work with them), median beside
    a load less median without, less the same difference over the other layers (the attention
    step's own slowdown, which `copy_attention_slowdown` prices on every layer). `quiet`: a run of
    the same batch that loads nothing on the same read-back path (ondemand with every expert
    resident), the quiet side of both differences where `log` has under `START_MIN` passes
    without a load (oracle with few slots). None where layer `first` has under `START_MIN` passes
    on either side, or the others under `SLOW_MIN` spans. The pass's inputs cross the one H2D
    engine (`lean_io.pass_inputs`: the cache's slot) behind the load: on the H100s of the
    twenty-fourth and thirty-fifth sessions' runs layer 0's difference read 25-30 us and the other
    layers' 7-11 (BENCHMARKS.md, thirty-fifth session)."""
    one, rest = _split(tails_by_layer(log), first)
    if quiet is not None and len(one[False]) < START_MIN:
        q_one, q_rest = _split(tails_by_layer(quiet), first)
        one[False], rest[False] = q_one[False], q_rest[False]
    if min(len(one[True]), len(one[False])) < START_MIN or min(len(rest[True]), len(rest[False])) < SLOW_MIN:
        return None
    d = lambda g: float(np.median(g[True]) - np.median(g[False]))  # noqa: E731
    return (d(one) - d(rest)) / 1e6


def attention_tails(log, keep, moving=None) -> dict[bool, list]:
    """Each decode pass's attention span on the compute stream in the layers `keep(layer)` accepts,
    from the later of its start and the host's launch of it (the end of the layer's last
    `host_attention`: a GPU that waited for the host did not run slower), in us, keyed by whether a
    load was on the link at that point. `copy_slowdowns` reads every layer but the first;
    `benchmarks/layer0_tail.py` the first, whose span holds the pass's inputs and P. `moving`: the
    run's `_in_flight`, where the caller has it."""
    return _merged(tails_by_layer(log, moving), keep)


def tails_by_layer(log, moving=None) -> dict[int, dict[bool, list]]:
    """`attention_tails` of every layer, by layer: one scan, for a caller that splits them."""
    dec, moving = decode_passes(log), moving or _in_flight(log)
    issued = {(s[STEP], s[LAYER]): s[END] for s in log.spans if s[OP] == "host_attention"}   # the last, in order
    out: dict[int, dict[bool, list]] = {}
    for s in log.spans:
        if s[STEP] in dec and s[STREAM] == "compute" and s[OP] == "attention":
            t0 = max(s[START], issued.get((s[STEP], s[LAYER]), s[START]))
            out.setdefault(s[LAYER], {True: [], False: []})[moving(t0)].append(s[END] - t0)
    return out


def _merged(by_layer: dict, keep) -> dict[bool, list]:
    """`tails_by_layer`'s layers that `keep(layer)` accepts, together, keyed as `attention_tails`'."""
    out: dict[bool, list] = {True: [], False: []}
    for layer, got in by_layer.items():
        if keep(layer):
            out[True] += got[True]
            out[False] += got[False]
    return out


def _split(by_layer: dict, first: int) -> tuple[dict, dict]:
    """`tails_by_layer` as (layer `first`'s, every other layer's)."""
    return _merged(by_layer, lambda layer: layer == first), _merged(by_layer, lambda layer: layer != first)


def _routes(log, first: int) -> list:
    """The compute stream's `route` spans of the run's decode passes, layer `first` (the pass's
    start-up) left out: what each route statistic here compares."""
    dec = decode_passes(log)
    return [s for s in log.spans if s[STEP] in dec and s[OP] == "route" and s[STREAM] == "compute" and s[LAYER] != first]


def _in_flight(log):
    """t -> whether a load of the run was on the link at t (begun at or before it, not yet ended)."""
    loads = sorted((s[START], s[END]) for s in log.spans if s[OP] == "load" and s[END] > s[START])
    starts = np.array([a for a, _ in loads])
    ends = np.maximum.accumulate(np.array([b for _, b in loads])) if loads else np.array([])

    def moving(t: float) -> bool:                    # the last load begun by `t` still on the link
        i = int(np.searchsorted(starts, t, side="right")) - 1
        return i >= 0 and bool(ends[i] > t)
    return moving


def _weighted(groups: list[dict[bool, list]], compare) -> float | None:
    """compare(busy median, quiet median) of each group with `SLOW_MIN` spans of each side, the
    groups weighted by their sizes; None where no group has."""
    ok = [(len(g[True]) + len(g[False]), float(compare(np.median(g[True]), np.median(g[False]))))
          for g in groups if len(g[True]) >= SLOW_MIN and len(g[False]) >= SLOW_MIN]
    return sum(n * r for n, r in ok) / sum(n for n, _ in ok) if ok else None


def start_excess_s(log, first: int) -> float:
    """Layer `first`'s excess over the mean of the others (its attention and route spans, the median
    over the decode passes), in seconds: commit's over upper's is what its pass start adds (the fit
    takes host_sync_us off it: `commit_start_us`). The median: a pass whose host stalled puts
    milliseconds into layer 0 (`upper`'s is ~35 us with passes at 190-240), and one calibration's
    mean read 514 us of commit start where another's read 44 and the runs showed 125-188 (an H100,
    twenty-third session)."""
    dec = decode_passes(log)
    per: dict[int, dict[int, float]] = {}
    for s in log.spans:
        if s[STEP] in dec and s[STREAM] == "compute" and s[OP] in ("attention", "route") and s[LAYER] >= 0:
            layer = per.setdefault(s[STEP], {})
            layer[s[LAYER]] = layer.get(s[LAYER], 0.0) + s[END] - s[START]
    ex = [lay[first] - float(np.mean([v for k, v in lay.items() if k != first]))
          for lay in per.values() if first in lay and len(lay) > 1]
    return float(np.median(ex)) / 1e6 if ex else 0.0
