"""The host's pass boundary in a measured run, against the profile's price (issue 15's layer-0
misses, forty-fifth session): a decode pass's LM-head host step (`host_head`), then the next pass's
start as calibrate reads it (`cmoe.calibrate.spans`: the host lane's gap from that head's end to the
next pass's first `host_attention`, plus that pass's layer-0 excess over its other layers), beside
what the simulator charges for the same boundary (`host_head_us`, `host_pass_start_us` and its
extra after a pass as long, `pass_start_extra_us`).

Where the runs' boundary is longer than the GPU's last layer and head, the GPU waits at layer 0:
on an H100 (b4dd528) the boundary took 0.54-0.62x the price where a pass loaded four experts or
fewer and 1.1-1.9x where it loaded nine or more, which is where layer 0's every-layer misses sat
(BENCHMARKS.md; `benchmarks/boundary_by_wait.py`). A policy that reads nothing back (`upper`) runs
its host passes ahead: its gaps are waits, not a boundary, so it has none.
"""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.spans import first_excess, host_gaps, host_marks
from cmoe.core.timeline import END, OP, START, STEP


def boundaries(run) -> list[tuple[float, float, float, int, float]]:
    """Per pair of consecutive decode passes p, p + 1 of a run (`cmoe.analysis.validate.Run`: its
    `spans` and `passes`), p with its head and the next with two layers or more: (p's last
    read-back wait, p's head, the next pass's start, p's loads, p's latency), us."""
    dec = sorted(p["pass"] for p in run.passes if p["decode"])
    lat = {p["pass"]: p["us"] for p in run.passes}
    marks = host_marks(run, dec)
    head, _, att = marks
    wait: dict[int, tuple[float, float]] = {}               # pass -> (start, length) of its last read-back
    loads: dict[int, int] = {}
    for s in run.spans:
        if s[OP] == "host_sync" and s[START] >= wait.get(s[STEP], (-1e30, 0.0))[0]:
            wait[s[STEP]] = (s[START], s[END] - s[START])
        elif s[OP] == "load":
            loads[s[STEP]] = loads.get(s[STEP], 0) + 1
    return [(wait.get(p, (0.0, 0.0))[1], head[p][1] - head[p][0], gap + first_excess(att[q]), loads.get(p, 0), lat[p])
            for p, q, gap in host_gaps(run, dec, marks) if q == p + 1 and len(att.get(q, {})) > 1]


def boundary_ratio(run, prof, cpu_experts: bool = False) -> tuple[float, float] | None:
    """(the run's median boundary, head plus the next start, us; that over the profile's median
    price for the same passes, as the simulator charges it: a CPU-expert policy's own pass start
    where calibrated, without the extra after a long pass); None for a run without read-backs (its
    host runs ahead), without pairs, or a profile that prices the boundary at nothing. `commit`'s
    read-back and plan of layer 0's prediction at its pass start (`host_sync_us`, `commit_start_us`)
    are left out on both sides: its runs wait for that read-back inside layer 0's step."""
    rows = np.array(boundaries(run))
    if not rows.size or not rows[:, 0].any():
        return None
    extra = 0.0 if prof.startup_after_host(cpu_experts) else float(np.median([prof.pass_start_extra_us(x) for x in rows[:, 4]]))
    price = prof.host_head_us + prof.host_pass_start(cpu_experts) + extra
    if price <= 0:
        return None
    took = float(np.median(rows[:, 1] + rows[:, 2]))
    return took, took / price
