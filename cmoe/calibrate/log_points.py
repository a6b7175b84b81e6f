"""What calibrate reads off single runs' timelines, beside `spans` and `commit_steps`: each fused
expert launch of an `upper` run (`_wave_points`), each CPU expert and round trip (`_cpu_points`),
the host's own time around a layer's CPU experts (`_cpu_steps`), and what issuing one load costs
the host (`_load_cost`)."""

from __future__ import annotations

import numpy as np

from cmoe.calibrate.spans import _per_layer, decode_passes
from cmoe.core.spec import ModelSpec
from cmoe.core.timeline import END, EXPERT, LAYER, OP, START, STEP


def _wave_points(log, tr, batch: int, spec: ModelSpec) -> list[list[float]]:
    """[experts, rows, seconds, mean expert bytes] of every decode layer's fused launch in an
    `upper` run (one launch per layer: its experts' spans split its time evenly)."""
    from cmoe.trace.passes import make_passes
    passes = make_passes(tr, batch)
    moe = {d: m for m, d in enumerate(spec.moe_layers)}
    dec = decode_passes(log)
    by: dict[tuple[int, int], list] = {}
    for s in log.spans:
        if s[STEP] in dec and s[OP] == "expert":
            by.setdefault((s[STEP], s[LAYER]), []).append(s)
    out = []
    for (p, d), spans in sorted(by.items()):
        m = moe[d]
        votes = dict(zip(passes[p].needed[m], passes[p].votes[m]))
        nbytes = float(np.mean([tr.expert_bytes[m][s[EXPERT]] for s in spans]))
        out.append([len(spans), sum(votes.get(s[EXPERT], 1) for s in spans),
                    (max(s[END] for s in spans) - min(s[START] for s in spans)) / 1e6, nbytes])
    return out


def _cpu_points(log, tr, batch: int, spec: ModelSpec) -> tuple[list, list]:
    """(tokens, seconds) of every CPU expert of the decode passes, its tokens from the trace's
    votes, and the round trip's two halves added up per layer (seconds)."""
    from cmoe.trace.passes import make_passes
    passes = make_passes(tr, batch)
    moe = {d: m for m, d in enumerate(spec.moe_layers)}
    dec = decode_passes(log)
    pts, trips = [], {}
    for s in log.spans:
        if s[STEP] not in dec:
            continue
        if s[OP] == "cpu_expert":
            ps, m = passes[s[STEP]], moe[s[LAYER]]
            votes = dict(zip(ps.needed[m], ps.votes[m]))
            pts.append((votes.get(s[EXPERT], 1), (s[END] - s[START]) / 1e6))
        elif s[OP] == "roundtrip":
            trips[(s[STEP], s[LAYER])] = trips.get((s[STEP], s[LAYER]), 0.0) + (s[END] - s[START]) / 1e6
    return pts, list(trips.values())


def _cpu_steps(log) -> dict[str, list[float]]:
    """Around each decode layer's CPU experts, on the host (seconds): from its last launch's issue
    to the first expert (`lead`: the step setting them up), between two experts (`gap`), and from
    the results' return (the last round trip's end) to the next layer's start (`tail`: their sum
    added, the finish launched); a layer with no launch or no next layer gives no lead or tail."""
    dec = decode_passes(log)
    by: dict[tuple[int, int], list] = {}
    for s in log.spans:
        if s[STEP] in dec:
            by.setdefault((s[STEP], s[LAYER]), []).append(s)
    out: dict[str, list[float]] = {"lead": [], "gap": [], "tail": []}
    keys = sorted(by)
    for i, k in enumerate(keys):
        cpu = sorted((s for s in by[k] if s[OP] == "cpu_expert"), key=lambda s: s[START])
        if not cpu:
            continue
        issued = [s[END] for s in by[k] if s[OP] == "host_expert"]
        if issued:
            out["lead"].append((cpu[0][START] - max(issued)) / 1e6)
        out["gap"] += [(b[START] - a[END]) / 1e6 for a, b in zip(cpu, cpu[1:])]
        back = [s[END] for s in by[k] if s[OP] == "roundtrip"]
        nxt = [s[START] for s in by[keys[i + 1]] if s[OP] == "host_attention"] \
            if i + 1 < len(keys) and keys[i + 1][0] == k[0] else []
        if back and nxt:
            out["tail"].append((min(nxt) - max(back)) / 1e6)
    return out


def _load_cost(log, upper_route_us: float, cuda: bool) -> float:
    """Host seconds per load: the route phase's excess over `upper`'s (per pass, us) spread over
    the loads issued, less the copy itself where the host copies (on a CPU)."""
    dec = decode_passes(log)
    loads = [s for s in log.spans if s[STEP] in dec and s[OP] == "load"]
    if not loads:
        return 0.0
    route, _ = _per_layer(log, ("host_route",), None)
    per = (route - upper_route_us) * len(dec) / len(loads)
    if not cuda:
        per -= float(np.mean([s[END] - s[START] for s in loads]))
    return max(per, 0.0) / 1e6
