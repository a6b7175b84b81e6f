"""The host's pass boundary in a measured run, against the profile's price (issue 15's layer-0
misses, forty-fifth session): a decode pass's LM-head host step (`host_head`), then the next pass's
start as calibrate reads it (`cmoe.calibrate.spans`: the host lane's gap from that head's end to the
next pass's first `host_attention`, plus that pass's layer-0 excess over its other layers), beside
what the simulator charges for the same boundary (`host_head_us`, `host_pass_start_us` and its
extras after a pass as long, `pass_start_extra_us`, and after its last read-back wait as long,
`boundary_extra_us`).

Where the runs' boundary is longer than the GPU's last layer and head, the GPU waits at layer 0:
on an H100 (b4dd528) the boundary took 0.54-0.62x the price where a pass loaded four experts or
fewer and 1.1-1.9x where it loaded nine or more, which is where layer 0's every-layer misses sat
(BENCHMARKS.md; `benchmarks/boundary_by_wait.py`). A policy that reads nothing back (`upper`) runs
its host passes ahead: its gaps are waits, not a boundary, so it has none.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from cmoe.calibrate.wake import boundary_pairs, pass_start_samples


def boundaries(run) -> list[tuple[float, float, float, int, float]]:
    """Per pair of consecutive decode passes p, p + 1 of a run (`cmoe.analysis.validate.Run`: its
    `spans` and `passes`), p with its head and the next with two layers or more: (p's last
    read-back wait, p's head, the next pass's start, p's loads, p's latency), us; calibrate's own
    reading of a pair (`cmoe.calibrate.wake.pass_start_samples`), the start from the head."""
    return boundary_rows(run)[0]


def boundary_rows(run) -> tuple[list[tuple[float, float, float, int, float]], list[float]]:
    """(`boundaries(run)`, and per row the next pass's host speed: the median of its
    `host_attention` times past its first layer, us; the same few launches in every layer). The
    speed is not something the simulator can know: on four H100 loans (forty-eighth session) the
    host lane ran for tens of passes at ~2.2-2.7 us a layer, then at ~5, everything on it slowing
    together, and the boundary with it (median 173-242 us in the fast state, 553-601 in the slow),
    while within a run and a state neither the last wait nor the loads moved it
    (`benchmarks/boundary_states.py`)."""
    return log_boundary_rows(SimpleNamespace(spans=run.spans, pass_us=[(p["pass"], p["decode"], 0, p["us"])
                                                                         for p in run.passes]))


def log_boundary_rows(log) -> tuple[list[tuple[float, float, float, int, float]], list[float]]:
    """`boundary_rows` of an executor's log (`spans`, `pass_us`), from one reading of its pairs."""
    got = pass_start_samples(log, boundary_pairs(log))
    return [(w, head, gap + excess, int(n), lat) for lat, gap, _, excess, head, n, w, _ in got], [x[7] for x in got]


def host_state(log, slow_us: float) -> tuple[float, float]:
    """(the share of an executor log's pass boundaries whose next pass's host ran at `slow_us` a
    layer or more, `log_boundary_rows`' speeds; the median boundary, head plus the next start, us);
    (nan, nan) without a boundary. What `benchmarks/affinity_probe.py` holds a pinned host
    thread's runs to. A fixed threshold, not `cmoe.analysis.states.slow_host`'s split: the probe
    compares runs, and a run wholly in the slow state has no split (one H100 host's runs, fifty-first
    session: 0-96% of their passes past 3 us)."""
    rows, speeds = log_boundary_rows(log)
    if not rows:
        return float("nan"), float("nan")
    return float((np.array(speeds) >= slow_us).mean()), float(np.median([head + start for _, head, start, _, _ in rows]))


def boundary_price(rows: list, prof, cpu_experts: bool = False) -> tuple[float, float] | None:
    """(the median of `boundaries`' rows, head plus the next start, us; the profile's median price
    for the same passes, as the simulator charges it, with the extra after a long pass and after a
    long last wait (`boundary_extra_us`); a CPU-expert policy's own pass start where calibrated,
    without either); None for a run without read-backs (its host
    runs ahead), without pairs, or a profile that prices the boundary at nothing. `commit`'s
    read-back and plan of layer 0's prediction at its pass start (`host_sync_us`, `commit_start_us`)
    are left out on both sides: its runs wait for that read-back inside layer 0's step."""
    a = np.array(rows)
    if not a.size or not a[:, 0].any():
        return None
    price = float(np.median([prof.boundary_price_us(x, w, cpu_experts) for w, x in zip(a[:, 0], a[:, 4])]))
    return (float(np.median(a[:, 1] + a[:, 2])), price) if price > 0 else None
