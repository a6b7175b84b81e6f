"""What calibrate reads off single runs' timelines, beside `spans` and `commit_steps`: each fused
expert launch of an `upper` run (`_wave_points`), each CPU expert and round trip (`_cpu_points`),
the host's own time around a layer's CPU experts (`_cpu_steps`), and what issuing one load costs
the host (`_load_cost`)."""

from __future__ import annotations

import math

import numpy as np

from cmoe.calibrate.spans import _mean, _per_layer, decode_passes, first_excess, host_gaps, host_marks
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


def cpu_experts(log, tr, batch: int, spec: ModelSpec):
    """Every CPU expert span of the run in start order, each with its tokens from the trace's votes
    in a decode pass (None in the prefill, whose experts are not measured but end an idle)."""
    from cmoe.trace.passes import make_passes
    passes = make_passes(tr, batch)
    moe = {d: m for m, d in enumerate(spec.moe_layers)}
    dec = decode_passes(log)
    for s in sorted((s for s in log.spans if s[OP] == "cpu_expert"), key=lambda s: s[START]):
        if s[STEP] in dec:
            ps, m = passes[s[STEP]], moe[s[LAYER]]
            yield s, dict(zip(ps.needed[m], ps.votes[m])).get(s[EXPERT], 1)
        else:
            yield s, None


def _cpu_points(log, tr, batch: int, spec: ModelSpec) -> tuple[list, list]:
    """(tokens, seconds, idle seconds) of every CPU expert of the decode passes (`cpu_experts`), its
    idle the CPU's since the run's CPU expert before it ended (inf: none before); and the round
    trip's two halves added up per layer (seconds)."""
    dec = decode_passes(log)
    pts, trips, end = [], {}, float("-inf")
    for s, tokens in cpu_experts(log, tr, batch, spec):
        if tokens is not None:
            pts.append((tokens, (s[END] - s[START]) / 1e6, (s[START] - end) / 1e6))
        end = s[END]
    for s in log.spans:
        if s[STEP] in dec and s[OP] == "roundtrip":
            trips[(s[STEP], s[LAYER])] = trips.get((s[STEP], s[LAYER]), 0.0) + (s[END] - s[START]) / 1e6
    return pts, list(trips.values())


IDLE_BINS_US = (0.0, 100.0, 300.0, 1000.0, 3000.0)      # a CPU expert's idle before it, binned (`cpu_in_model`)


def cpu_runs(r, w, cfg, batch: int) -> None:
    """calibrate's `static` runs, whose CPU experts, round trips and host around them it keeps (in
    `r`): dense (slots = top-k: a CPU expert in nearly every layer, at batch 8 several in a row) and,
    at batch 1, sparse (every expert but one resident: CPU experts far apart, so the CPU has idled
    between them as in a pool that holds most experts, `cpu_wake_points`)."""
    from dataclasses import replace
    from cmoe.executor.run import run_policy
    spec = r.spec
    r.cpu_pages = w.store.cpu_huge_share()          # the pages its CPU experts sit on (`cmoe.core.hugepages`)
    for slots in [spec.top_k] + ([spec.num_experts - 1] if batch == 1 and spec.num_experts - 1 > spec.top_k else []):
        tokens = min(r.tokens, 8) if slots == spec.top_k else r.tokens
        st = run_policy(w, replace(cfg, policies=("static",), slots=slots, tokens=tokens), "static").log
        p, t = _cpu_points(st, w.trace, batch, spec)
        one = [x for k, x, gap in p if k == 1 and gap < IDLE_BINS_US[1] / 1e6]
        if one:                                # the run's one-token experts back to back: how runs differ
            r.cpu_runs.append([batch, "dense" if slots == spec.top_k else "sparse", float(np.mean(one)), len(one)])
        r.cpu_pts += p
        r.trips += [(batch, x) for x in t]
        for k, v in _cpu_steps(st, passes=r.queued).items():
            r.cpu_steps.setdefault(k, []).extend(v)


def cpu_in_model(pts: list, trips: list, steps: dict, runs: list | None = None) -> dict:
    """The measurements of the CPU experts inside the running model: per token count the mean and
    the count (means, not medians: CPU experts have a long tail, on the H200's host 2-9% took over
    9 ms against a 1.8 ms median, and throughput pays for it); the same by idle before them
    (`IDLE_BINS_US`: [tokens, bin's lower edge us, mean idle us, mean seconds, count]; a run's first
    expert, which follows none, in none); the round trip's median, over all and per batch (`trips`:
    (batch, seconds) per layer); the host around a CPU layer's experts, means (`cpu_lead_us` ..);
    and each run's one-token experts back to back (`runs`: [batch, dense or sparse, mean seconds,
    count]), where runs on one machine minutes apart differed 0.7-1.5x (twenty-ninth session)."""
    by: dict[int, list] = {}
    idle: dict[tuple[int, float], list] = {}
    for t, x, gap in pts:
        by.setdefault(int(t), []).append(x)
        if math.isfinite(gap):                             # a run's first: no idle it follows, in no bin
            lo = max(b for b in IDLE_BINS_US if gap * 1e6 >= b) if gap >= 0 else 0.0
            idle.setdefault((int(t), lo), []).append((gap, x))
    return {"cpu_expert_in_model": {"points": [(t, float(np.mean(v))) for t, v in sorted(by.items())],
                                    "count": [(t, len(v)) for t, v in sorted(by.items())],
                                    "idle": [[t, lo, float(np.mean([g for g, _ in v])) * 1e6,
                                              float(np.mean([x for _, x in v])), len(v)]
                                             for (t, lo), v in sorted(idle.items())],
                                    "runs": list(runs or [])},
            "roundtrip_in_model": float(np.median([s for _, s in trips])) if trips else None,
            "roundtrip_points": [(b, float(np.median([s for x, s in trips if x == b]))) for b in sorted({b for b, _ in trips})],
            "cpu_step": {k: float(np.mean(v)) for k, v in _with_pass_means(steps).items() if v},
            # per pair of queued decode passes: [CPU layers of the first, the second's rows, pass start s, gap s]
            "cpu_pass_points": list(steps.get("pass_points", []))}


def _with_pass_means(steps: dict) -> dict[str, list[float]]:
    """`_cpu_steps`' lists with the pass points' starts and gaps (`pass_start`, `pass_gap`) in place
    of the points themselves."""
    pp = steps.get("pass_points") or []
    return {k: v for k, v in steps.items() if k != "pass_points"} | (
        {"pass_start": [p[2] for p in pp], "pass_gap": [p[3] for p in pp]} if pp else {})


def _cpu_steps(log, passes: bool = True) -> dict[str, list[float]]:
    """Around each decode layer's CPU experts, on the host (seconds): from its last launch's issue
    to the first expert (`lead`: the step setting them up), between two experts (`gap`), and from
    the results' return (the last round trip's end) to the next layer's start (`tail`: their sum
    added, the finish launched); a layer with no launch or no next layer gives no lead or tail.
    And with `passes` (a run whose decode passes were queued, `pass_overlap`: a synced pass's gap
    would hold its wait for the GPU's head, which the simulator charges apart) per pair of decode
    passes the CPU layers of the first, the second's rows, the pass start a CPU-expert policy's host
    pays and the part of it before the pass's first mark (`pass_points`: `_pass_starts`), whose
    means `cpu_in_model` takes."""
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
    if passes and any(s[OP] == "cpu_expert" for ss in by.values() for s in ss):
        out["pass_points"] = [[n, rows, g + e, g] for n, rows, g, e in _pass_starts(log, sorted(dec))]
    return out


def _pass_starts(log, dec: list[int]) -> list[tuple[int, int, float, float]]:
    """Per pair of consecutive decode passes: the layers with CPU experts in the first, the second's
    rows, and (seconds) the host's gap from the first's `host_head` to the second's first
    `host_attention` (its books and the caller's loop, before the pass's first mark) and that first
    layer's excess over the pass's other layers (`host_attention` each). The last two's sum is what
    `host_pass_start_us` measures (`spans._host_between`), here pass by pass in a run whose host the
    CPU experts hold back, so both fall in the GPU's idle. An H100's CPU-expert runs (thirtieth
    session) paid 205-387 us a pass, 89-174 of it the gap, where the eager GPU-only runs calibrate's
    pass start comes from paid 146-164; it grew with the CPU layers of the pass before, by 1.0-3.9
    us a layer from validation to validation (sessions 30-31, `cpu_wake_diagnosis.py`), too unsteady a
    slope to model, so calibrate records the pairs (`cpu_pass_points`) and fits none."""
    marks = host_marks(log, dec)
    cpu: dict[int, set] = {}
    for s in log.spans:
        if s[OP] == "cpu_expert":
            cpu.setdefault(s[STEP], set()).add(s[LAYER])
    rows = {p: n for p, _, n, _ in log.pass_us}
    return [(len(cpu.get(p, ())), rows[q], gap / 1e6, max(first_excess(marks[2][q]), 0.0) / 1e6)
            for p, q, gap in host_gaps(log, dec, marks)]


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
        per -= _mean(log, "load") * 1e6
    return max(per, 0.0) / 1e6
