"""The host's side of `cmoe.calibrate.measure_model`'s runs: each eager run's host figures, the rounds
that repeat them over every batch size (`HOST_ROUNDS`, moments apart: a lent machine's host speed
moves within seconds), the tables made of them, and the same for the executor's Python step (the
program off). `r` is `measure_model._ModelRuns`; the runs come from `cmoe.executor.run.run_policy`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from cmoe.calibrate.spans import _gaps, _host_between, _mean, _per_layer, _sync_s
from cmoe.core.util import env_var

HOST_ROUNDS = 2       # rounds of two eager runs per batch size for the host's side


def _host_run(r, log) -> dict:
    """One eager run's host figures, in seconds: per decoder layer issuing the attention side (`layer`,
    the pass's start-up excess `start` in us; queued, the host's whole pass start `between`), the route
    per MoE layer (`route`), a launch (`expert`) and an expert's compute span (`expert_span`: on a
    host-bound GPU the host's time between its two marks), the read-back wait's median (`sync`), the
    LM head's host time (`head`) and, on the lean engine, the read-back's gaps (`gaps`)."""
    ne, start = _per_layer(log, ("host_attention",), r.first)
    return {"layer": ne / r.L / 1e6, "start": start, "route": _per_layer(log, ("host_route",), None)[0] / r.M / 1e6,
            "expert": _mean(log, "host_expert"), "expert_span": _mean(log, "expert"),
            "sync": _mean(log, "host_sync", np.median), "gaps": _gaps(log) if r.lean else [],
            "between": _host_between(log, r.first) if r.queued else None, "head": _mean(log, "host_head")}


def _python_step(r, w, hc, batch: int) -> None:
    """The host of the executor's Python step, which plans with the program off (`policies.python_step`): a
    round of three eager `ondemand` runs, the program off, the last two kept; as many rounds as the program's."""
    from cmoe.executor.run import run_policy
    with env_var("CMOE_HOST_PROGRAM", "0"):            # restored as it was on the way out
        run_policy(w, hc, "ondemand")                  # untimed: the step's first run after the program's
        r.py_runs.setdefault(batch, []).extend(_host_run(r, run_policy(w, hc, "ondemand").log) for _ in range(2))


def _python_host(r) -> tuple[dict, dict]:
    """`_host_figures` over the Python step's runs (no pass start where passes are not queued: the
    program's is kept), and its route and launch runs for `repeats`."""
    ph: dict[str, list] = {k: [] for k in r.host}
    _host_points(SimpleNamespace(host=ph, host_runs=r.py_runs), sorted(r.py_runs))
    rep = {f"Py step, {k}": {"unit": "tokens", "grows": False, "judged": False,
                             "points": [[b, [x[k] for x in v]] for b, v in sorted(r.py_runs.items())]}
           for k in ("route", "expert")}
    return _host_figures(ph, r.py_runs), rep


def _host_figures(host: dict, runs: dict[int, list[dict]]) -> dict:
    """What `_result` reports of a host from `_host_points`' tables and each batch's runs: the table
    points; the launch's tail (after the kernel's end mark) at the table's first two points (batches
    1 and 8 on a CPU, 1 and 2 on CUDA); the read-back; the LM head, the median of the first batch's
    runs of every round (one round's pair: 36-103 us, an H100); with queued passes the pass start,
    the median of every run's `_host_between` (else None)."""
    tail = [(t, max(a[1] - b[1], 0.0)) for t, a, b in zip((1, 8), host["expert"], host["expert_span"])]
    starts = [x["between"] for v in runs.values() for x in v if x["between"] is not None]
    return {"layer_points": host["layer"], "route_points": host["route"], "expert_points": host["expert"],
            "expert_tail_s": float(np.mean([x for _, x in tail])), "sync_s": _sync_s(host, tail),
            "head_s": float(np.median([x["head"] for x in runs[min(runs)]])),
            "pass_start_s": float(np.median(starts)) if starts else None}


def _host_round(r, batch: int) -> None:
    """A later round of the host's side at `batch`: two more eager runs of its workload, after one
    untimed (the model was last run at another batch size)."""
    from cmoe.executor.run import run_policy
    w, hc = r.host_work[batch]
    run_policy(w, hc, "ondemand")
    r.host_runs[batch] += [_host_run(r, run_policy(w, hc, "ondemand").log) for _ in range(2)]
    if batch in r.py_runs:
        _python_step(r, w, hc, batch)


def _host_points(r, batches) -> None:
    """The host's table points from every round's runs: per batch, the mean over its runs (each
    run's own figure kept under `repeats`)."""
    host = r.host
    for batch in batches:
        runs = r.host_runs[batch]
        host["layer_runs"].append([batch, [x["layer"] for x in runs]])
        host["route_runs"].append([batch, [x["route"] for x in runs]])
        host["expert_runs"].append([batch, [x["expert"] for x in runs]])
        for k in ("layer", "route", "expert", "expert_span"):
            host[k].append((batch, float(np.mean([x[k] for x in runs]))))
        host["sync"] += [x["sync"] for x in runs]
        host["waits"].append((batch, float(np.mean([x["sync"] for x in runs]))))   # what its route followed
        host["gaps"] += [g for x in runs for g in x["gaps"]]


def cpu_lanes(r) -> None:
    """On a CPU the compute lane's spans are the host's own (`attention` and `host_attention` are one
    span, as are `expert` and its host time, `head` and `host_head`), so its figures are every round's
    runs (`_host_points`), not the first round's first run, which set them before. Why: two
    calibrations a minute apart on the forty-fourth session's 2-core AMD EPYC put the layer outside
    the experts at 465 and 317 us from that one run while the rounds' mean said 387 and 328; the
    first made `upper` predicted 20% slow (139 tok/s against 174 measured)."""
    r.gpu["points"] = list(r.host["layer"])
    r.gpu["expert"] = list(r.host["expert_span"])
    ones = r.host_runs[1]
    r.one["gpu_start"] = float(np.mean([x["start"] for x in ones])) / 1e6
    r.one["gpu_head"] = float(np.mean([x["head"] for x in ones]))
