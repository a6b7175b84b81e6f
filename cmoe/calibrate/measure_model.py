"""What `cmoe calibrate` measures from the executor's own timeline: short runs of the model (the
one just built, or the preset cut to its first layers) under `upper`, `commit`, `ondemand`,
`lru-prefetch`, `oracle` and `static`, on the host's lane and on the compute stream. On CUDA a run whose GPU is held back
(`lead_us`) lets the host get ahead, so its compute spans are the GPU's own time; on the CPU both
sides are the same run. Means, not best-of: throughput pays for the slow passes too. The host's
layer time of each eager run is kept under `repeats` ("host, layer"), so that the noise verdict
(`cmoe.calibrate.noise.noise`) sees how far runs of the same model disagree, and so is an expert
kernel's mean time at batch 1 and 8 (it may not fall with rows); the runs' route and per-expert
host times are kept there too, shown with their spread but not judged, and so are the layer's
runs at a short and a long prompt ("layer, context": their medians price attention per key).

The host's side is measured in rounds (`cmoe.calibrate.host_runs`) over every batch size, not all at once per
batch: a lent machine's host speed moves within seconds (on the H200's host the ninth session saw
one calibration's batch-2 runs take twice the time per layer of its batch-1 and batch-4 runs, a
bump no host cost has), so each batch's figure is a mean over moments apart, and a slow stretch
spreads over the whole table instead of bending one point of it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from cmoe.calibrate import wake
from cmoe.calibrate.host_runs import (HOST_ROUNDS, _host_figures, _host_points, _host_round, _host_run, cpu_lanes,
                                       _python_host, _python_step)
from cmoe.calibrate.commit_steps import (commit_gpu_s, copy_slowdowns, launch_copy_points, launch_copy_s,
                                          readback_copy_s, start_copy_s, start_excess_s)
from cmoe.calibrate.log_points import _load_cost, _wave_points, cpu_in_model, cpu_runs
from cmoe.core.spec import ModelSpec
from cmoe.calibrate.spans import _mean, _pass_overhead, _per_layer, load_copies, queued_period


LONG_PROMPT = 2048    # the context of the long run that prices attention per key (a CPU uses an eighth)
CONTEXT_RUNS = 3      # runs of that long prompt (and on a CPU of a short one); their medians price it
LEAD_US = 5000.0      # GPU sleep queued before each layer's experts in the GPU-time run: longer than
                      # the host takes to issue a layer's experts and the next layer's attention


class _ModelRuns:
    """The short runs `layers` makes of one model, and what they have measured so far: the GPU's
    side (`gpu`), the host's (`host`), CPU experts and round trips, and batch 1's own figures
    (`one`). `w`: the workload of the latest run, whose model and store the next one reuses."""

    def __init__(self, device: torch.device, spec: ModelSpec, fmt: str, model_dir, tokens: int, built):
        from cmoe.executor.run import budget_recipe
        self.device, self.spec, self.fmt, self.model_dir, self.tokens = device, spec, fmt, model_dir, tokens
        self.rec = budget_recipe(fmt)
        self.cuda = device.type == "cuda"
        self.first = spec.moe_layers[0]
        self.L, self.M = spec.num_layers, spec.num_moe_layers
        self.gpu: dict[str, list] = {"points": [], "expert": [], "waves": [], "plain_points": [], "readback": [],
                                     "launch_copy": []}
        self.host: dict[str, list] = {"layer": [], "route": [], "expert": [], "expert_span": [], "sync": [], "waits": [],
                                      "layer_runs": [], "route_runs": [], "expert_runs": [], "gaps": []}
        self.host_runs: dict[int, list[dict]] = {}    # batch -> each eager run's host figures (`_host_run`)
        self.host_work: dict[int, tuple] = {}         # batch -> (workload, config) of its eager runs
        self.py_runs: dict[int, list[dict]] = {}      # batch -> the Python step's eager runs (`_python_step`)
        self.cpu_pts: list = []
        self.trips: list = []
        self.cpu_steps: dict = {}
        self.cpu_runs: list = []
        self.cpu_pages: float | None = None           # share of the CPU experts' bytes on huge pages
        self.cpu_experts = True                       # CPU copies in the store and `static` runs (`cpu_runs`)
        self.one: dict[str, float] = {}
        self.wake: dict = {}                          # `cmoe.calibrate.wake.measure`'s (CUDA only)
        self.seconds: dict[str, float] = {}     # wall time of each step: what calibrating costs, reported
        self._lap = time.perf_counter()
        self.w = built
        self.split_point = False                      # time the short prompt in a long cache (`_context_points`)

    def lap(self, key: str | None) -> None:
        """`seconds[key]`: the wall time since the last lap (None: start one, nothing kept). Batch 1
        took 25-112 s across the H100 sessions' calibrations; its laps say which of its runs take it."""
        now = time.perf_counter()
        if key is not None:
            self.seconds[key] = now - self._lap
        self._lap = now

    @property
    def queued(self) -> bool:
        """The lean engine queues its graphed decode passes (`lean_program.queues_passes`)."""
        from cmoe.executor.lean_program import queues_passes
        return queues_passes(self.cuda)

    @property
    def lean(self) -> bool:
        """The lean engine's fused launches on CUDA: the GPU-side figures come from upper's own run."""
        return self.cuda and self.w is not None and self.w.store.packing == "tiled"

    def on(self, params):
        """A workload replaying a synthetic trace on the model and store already there (if any)."""
        from cmoe.executor.run import Workload
        from cmoe.trace.synthetic import generate
        nw = Workload(spec=self.spec, device=self.device, fmt=self.fmt, trace=generate(self.spec, self.rec, params),
                      model_dir=self.model_dir)
        if self.w is not None:
            nw.store, nw.model, nw.shims = self.w.store, self.w.model, self.w.shims
        return nw


def layers(device: torch.device, spec: ModelSpec, fmt: str, num_layers: int, model_dir=None, tokens: int = 32,
           built=None, split_point: bool = False, cpu_experts: bool = True) -> dict:
    """What the executor's own timeline says a model costs outside the experts, on the GPU and on
    the host, at batch 1 and 8: a short `upper` run gives the host's side (its `host_*` spans); on
    CUDA a second run with GPU sleep queued ahead of each layer (`lead_us`) lets the host get
    ahead, so its compute spans are the GPU's own time (on the CPU both sides are the same run).
    Also the pass's start-up (layer 0's excess) and LM head on both sides, an expert's kernels
    inside the model on both sides, what predicting adds on the host per MoE layer (a `commit` run,
    all experts resident), and CPU experts and the round trip inside the model (a `static` run
    with top_k slots per layer, when the store has CPU copies of the experts); on CUDA, the route
    step after longer read-back waits (`cmoe.calibrate.wake`).

    `built`: a Workload already built (its model, store and spec are used as they are: the model
    the runs will use, in the state they will find it); otherwise the model is built here, cut to
    its first `num_layers` layers (same per-layer shapes). `split_point`: also time the short prompt
    in a long cache (CUDA, where the decode attention cuts its keys into runs: `_context_points`).
    `cpu_experts` false: a store without CPU copies (a profile for GPU-only policies alone)."""
    if built is not None:
        spec, model_dir = built.spec, built.model_dir
    elif model_dir is None:
        keep = tuple(d for d in spec.moe_layers if d < num_layers)
        spec = replace(spec, num_layers=num_layers, moe_layers=keep)
    r = _ModelRuns(device, spec, fmt, model_dir, tokens, built)
    r.split_point, r.cpu_experts = split_point and r.cuda, cpu_experts
    # every batch bucket the benchmarks use on a GPU, so the host's costs are tables, not lines
    # through two points; a CPU keeps two (its main job runs batch 1, and it is slow)
    batches = (1, 2, 4, 8, 16) if r.cuda else (1, 8)
    for batch in batches:
        t0 = time.perf_counter()
        _measure_batch(r, batch)
        r.seconds[f"batch {batch}"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(HOST_ROUNDS - 1):
        for batch in batches:
            _host_round(r, batch)
    _host_points(r, batches)
    if not r.cuda:
        cpu_lanes(r)
    r.seconds["host rounds"] = time.perf_counter() - t0
    if r.cuda:                        # the route step after long waits (GPU sleep makes them)
        t0 = time.perf_counter()
        r.wake = wake.measure(r)
        r.seconds["host after waits"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx = _context_points(r)
    r.seconds["long context"] = time.perf_counter() - t0
    return _result(r, ctx)


def _measure_batch(r: _ModelRuns, batch: int) -> None:
    """One batch size: warm up on `upper`, then the host's side from two eager `ondemand` runs with
    every expert resident (the first round: `_host_round` adds the later ones) and the GPU's from a
    queued `upper` run (on a CPU, the first eager run);
    at batch 1 also predicting and loads (`_batch_one`), at 1 and 8 CPU experts in the model."""
    from cmoe.executor.run import ExecConfig, build, run_policy
    from cmoe.trace.synthetic import SyntheticParams
    spec, gpu, L, M = r.spec, r.gpu, r.L, r.M
    r.w = w = r.on(SyntheticParams(requests=batch, prompt_len=16, decode_len=r.tokens + 4, seed=batch))
    cfg = ExecConfig(policies=("upper",), pool_gb=1e3, batch=batch, tokens=r.tokens, device=r.device.type)
    r.lap(None)
    if w.store is None:
        build(w, replace(cfg, policies=("upper", "static") if r.cpu_experts else ("upper",)))
        r.lap("build")
    run_policy(w, cfg, "upper")                               # warm-up over the same lengths
    r.lap(f"warm-up {batch}")
    # the host's side from ondemand with every expert resident: upper's work, plus the host step
    # every other policy takes (read-back, plan, dispatch), which the lean engine's upper skips
    hc = replace(cfg, policies=("ondemand",), slots=spec.num_experts)
    run_policy(w, hc, "ondemand")
    eager = [run_policy(w, hc, "ondemand").log for _ in range(2)]
    r.host_work[batch] = (w, hc)
    queued = run_policy(w, replace(cfg, lead_us=LEAD_US), "upper").log if r.cuda else eager[0]
    ne, start = _per_layer(queued, ("attention",), r.first)
    gpu["points"].append((batch, ne / L / 1e6))
    gpu["expert"].append((batch, _mean(queued, "expert")))
    runs = r.host_runs.setdefault(batch, [])
    runs += [_host_run(r, e) for e in eager]
    if r.lean:
        _python_step(r, w, hc, batch)
    h_start = float(np.mean([x["start"] for x in runs]))
    h_route = float(np.mean([x["route"] for x in runs])) * M * 1e6     # this round's, per pass (us)
    if r.lean:
        _lean_batch(r, w, cfg, batch, eager)
    if batch == 1:
        _batch_one(r, cfg, start, h_start, eager, queued, h_route)
    if batch in (1, 8) and r.cpu_experts and (not r.cuda or w.store.cpu_twins is not None):
        r.lap(None)
        cpu_runs(r, w, cfg, batch)
        r.lap(f"batch {batch}: static runs")


def _lean_batch(r: _ModelRuns, w, cfg, batch: int, eager: list) -> None:
    """The lean engine's fused launch: upper's own run is the GPU's time (its host keeps ahead, with
    no host step), for the layer outside the experts too; the eager runs' gaps price the read-back."""
    from cmoe.executor.run import run_policy
    gpu, L, M = r.gpu, r.L, r.M
    plain = run_policy(w, cfg, "upper").log
    gpu["waves"] += _wave_points(plain, w.trace, batch, r.spec)
    up = _per_layer(plain, ("attention",), r.first)[0]
    gpu["plain_points"].append((batch, up / L / 1e6))
    # what the read-back's packing adds to A_m on the GPU (the eager runs read back; upper does
    # not), charged per MoE layer; batch 1 keeps the eager runs' attention for the prediction's
    att = float(np.mean([_per_layer(e, ("attention",), r.first)[0] for e in eager]))
    gpu["readback"].append((batch, (att - up) / M / 1e6))
    if batch == 1:                # upper's layer-0 excess, the median's (`start_excess_s`), for commit's
        r.one["eager_attention"], r.one["plain"], r.one["plain_excess"] = att, _pass_overhead(plain, r.first), \
            start_excess_s(plain, r.first)
    if batch == 8:                # larger launches beside a load and not (batch 1's: `_batch_one`), `copy_launch_us`
        lc = replace(cfg, policies=("lru-prefetch",), slots=max(r.spec.top_k, 3 * r.spec.num_experts // 4),
                     tokens=min(r.tokens, 8))
        run_policy(w, lc, "lru-prefetch")                  # untimed: the policy's first run at this batch
        gpu["launch_copy"] += launch_copy_points(run_policy(w, lc, "lru-prefetch").log, r.first, batch)


def _batch_one(r: _ModelRuns, cfg, start: float, h_start: float, eager: list, queued, h_route: float) -> None:
    """Batch 1's own figures into `r.one`: the pass's start-up and LM head on both sides; what
    predicting adds per MoE layer and what commit adds to the route (two `commit` runs, every
    expert resident); what a moving load adds to the route, the launch and (oracle's) the pass's
    start-up; and what issuing one load costs the host (`ondemand` with top_k slots)."""
    from cmoe.executor.run import run_policy
    w, spec, M = r.w, r.spec, r.M
    one = r.one
    r.lap("batch 1: upper and ondemand runs")
    one["gpu_start"], one["gpu_head"] = start / 1e6, _mean(queued, "head")
    one["host_start"] = h_start / 1e6
    cc = replace(cfg, policies=("commit",), slots=spec.num_experts)
    run_policy(w, cc, "commit")
    c_log = run_policy(w, cc, "commit").log
    r.lap("batch 1: commit, resident")
    if r.lean:
        _lean_one(r, cfg, cc, c_log, eager)
    # the early router itself, timed on its own (every policy that predicts runs it), and what commit's larger
    # read-back and OWA add to the route (a difference of two runs' host times: noisy, so only the route's part)
    c_route, _ = _per_layer(c_log, ("host_route",), None)
    c_pred, _ = _per_layer(c_log, ("host_predict",), None)
    one["predict"] = c_pred / M / 1e6
    one["commit_route"] = max(c_route - h_route, 0.0) / M / 1e6
    # what issuing a load costs the host: ondemand with top_k slots misses often
    od = run_policy(w, replace(cfg, policies=("ondemand",), slots=spec.top_k, tokens=min(r.tokens, 8)),
                    "ondemand")
    one["host_load"], one["load_queue"] = _load_cost(od.log, h_route, r.cuda), queued_period(od.log) if r.cuda else None
    r.lap("batch 1: ondemand, loading")
    if r.cuda:                    # its pass boundary after long waits (`wake.fit_boundary`)
        one["loading_starts"] = wake.pass_start_samples(od.log)
    else:                         # on a CPU a load is the host's own copy between other work (`copied_fit`)
        one["load_copy"] = load_copies(od.log)


def _lean_one(r: _ModelRuns, cfg, cc, c_log, eager: list) -> None:
    """Batch 1's figures on the lean engine alone: what predicting adds on the GPU, and what moving
    loads do to the route step, the launches, commit's kernels and (oracle's) the pass's start."""
    from cmoe.executor.run import run_policy
    w, spec, M, one = r.w, r.spec, r.M, r.one
    # the next layer's router inside A_m, on the GPU: lru-prefetch (it predicts, on the read-back
    # path, so its attention spans are GPU time; commit's ahead path would add the host's wait)
    # over ondemand, every expert resident (no prefetch moves)
    lp = replace(cfg, policies=("lru-prefetch",), slots=spec.num_experts)
    p_att = _per_layer(run_policy(w, lp, "lru-prefetch").log, ("attention",), r.first)[0]
    one["predict_gpu"] = (p_att - one["eager_attention"]) / M / 1e6
    r.lap("batch 1: lru-prefetch, resident")
    # runs that load, a few tokens each. lru-prefetch with three quarters of the slots (layers that load
    # nothing of their own, beside a load it prefetched and not): its route step and launch beside a load
    # (`readback_copy_us`, `launch_copy_us`). commit with half: its launches (OWA on the device) over
    # upper's, the copies before them, moving or not, and what its loads do to the kernels beside them
    tokens = min(r.tokens, 8)
    rb_log = run_policy(w, replace(lp, record_plans=True, tokens=tokens,
                                   slots=max(spec.top_k, 3 * spec.num_experts // 4)), "lru-prefetch").log
    for key, f in (("readback_copy", readback_copy_s), ("launch_copy", launch_copy_s)):
        v = f(rb_log, r.first, spec.moe_layers)
        one[key] = max(v, 0.0) if v is not None else 0.0
    r.gpu["launch_copy"] += launch_copy_points(rb_log, r.first, 1)     # its launches beside a load and not
    r.lap("batch 1: lru-prefetch, loading")
    one["commit_waves"] = _wave_points(c_log, w.trace, 1, spec)
    ld = run_policy(w, replace(cc, slots=max(spec.top_k, spec.num_experts // 2), tokens=tokens), "commit").log
    one["commit_gpu"], one["commit_gpu_copy"], one["copy_slow"] = *commit_gpu_s(c_log, ld, r.first), copy_slowdowns(ld, r.first)
    one["commit_start"] = start_excess_s(c_log, r.first) - one["plain_excess"]     # over upper's layer 0
    r.lap("batch 1: commit, loading")
    # oracle with all the slots but one in 16: its loads go out ahead of their pass, so passes start
    # beside a moving load (`start_copy_us`); ondemand with every expert resident (its passes queued
    # too, the same read-back path) is the quiet side where oracle has few quiet passes
    slots = max(spec.top_k, spec.num_experts - max(1, spec.num_experts // 16))
    og = run_policy(w, replace(cfg, policies=("oracle",), slots=slots), "oracle").log
    one["start_copy"] = start_copy_s(og, r.first, eager[0])
    r.lap("batch 1: oracle")


def _context_points(r: _ModelRuns) -> list:
    """Attention against context: the GPU-time run again, one request with a long prompt. Returns
    [(mean keys per decode token, seconds per layer)] of a short prompt and of the long one, each the
    median of CONTEXT_RUNS runs (on CUDA the short point is batch 1's queued run). With
    `r.split_point` (CUDA, an attention that splits) also the short prompt in a cache as long as
    the long run's (`r.one["split_point"]`: [keys, seconds, cache slots], with the other two runs'
    caches in `r.one["context_caches"]`): the lean attention cuts a head's keys into runs sized by
    the cache, so a long cache costs at few keys too."""
    from cmoe.executor.run import ExecConfig, max_len, run_policy
    from cmoe.trace.synthetic import SyntheticParams
    prompt = LONG_PROMPT if r.cuda else LONG_PROMPT // 8
    lw = r.on(SyntheticParams(requests=1, prompt_len=prompt, decode_len=8 + 4, seed=3))
    lc = ExecConfig(policies=("upper",), pool_gb=1e3, batch=1, tokens=8, device=r.device.type,
                    lead_us=LEAD_US if r.cuda else 0.0)
    # a CPU times the short prompt too, in the long one's configuration, the two runs taking turns
    # (the host's speed drifts); CUDA keeps batch 1's queued run as the short point
    sh = None if r.cuda else r.on(SyntheticParams(requests=1, prompt_len=16, decode_len=8 + 4, seed=3))
    arms = [(prompt + 4.5, lw)] + ([(16 + 4.5, sh)] if sh is not None else [])     # (mean keys, workload)
    t0 = time.perf_counter()
    for _, x in arms:
        run_policy(x, lc, "upper")
    r.seconds["long context, first run"] = time.perf_counter() - t0
    # the medians of CONTEXT_RUNS: one run decided the slope before, and on a 2-core CPU a slow one
    # (524 against 380-387 us a layer) made batch 3's layers 48% slower than measured
    runs: dict[float, list] = {}
    for _ in range(CONTEXT_RUNS):
        for keys, x in arms:
            runs.setdefault(keys, []).append(_per_layer(run_policy(x, lc, "upper").log, ("attention",), r.first)[0]
                                             / r.L / 1e6)
    r.one["context_runs"] = [[k, v] for k, v in sorted(runs.items())]
    short = (16 + 4.5, float(np.median(runs[16 + 4.5]))) if sh is not None else \
        (16 + (r.tokens + 1) / 2, r.gpu["points"][0][1])
    if r.split_point:
        sw = r.on(SyntheticParams(requests=1, prompt_len=16, decode_len=prompt - 16 + 8 + 4, seed=3))
        run_policy(sw, lc, "upper")
        ne_split, _ = _per_layer(run_policy(sw, lc, "upper").log, ("attention",), r.first)
        r.one["split_point"] = [16 + 4.5, ne_split / r.L / 1e6, max_len(sw, lc)]
        w1, c1 = r.host_work[1]
        r.one["context_caches"] = [max_len(w1, c1), max_len(lw, lc)]
    return [short, (prompt + 4.5, float(np.median(runs[prompt + 4.5])))]  # mean keys per decode token


def _result(r: _ModelRuns, ctx: list) -> dict:
    """What `layers` returns: the measurements `cmoe.calibrate.profile_fit` fits, in its units."""
    from cmoe.core.quant import non_expert_bytes
    gpu, host, one, gap = r.gpu, r.host, r.one, None
    if "plain" in one:            # the lean engine: a pass's start and head as upper's own run shows them
        one["host_start"], one["gpu_start"], one["gpu_head"] = one.pop("plain")
        gap = one["host_start"] - one["gpu_start"]      # the GPU's idle gap between passes, before the first mark
    starts = [[b, [x["between"] for x in runs]] for b, runs in sorted(r.host_runs.items()) if runs[0]["between"] is not None]
    fig = _host_figures(host, r.host_runs)   # queued passes: the host's own lane's pass start (upper's is ahead)
    fig["pass_start_s"] = one["host_start"] if fig["pass_start_s"] is None else fig["pass_start_s"]
    ne_bytes = non_expert_bytes(r.spec, r.rec)
    per_layer = (ne_bytes["attention"] + ne_bytes["norms"]) // r.spec.num_layers
    out = {"layer": {"resident_bytes": int(per_layer), "points": gpu["plain_points"] or gpu["points"],
                     "head_s": one["gpu_head"],
                     "pass_start_s": one["gpu_start"], "expert_in_model_s": gpu["expert"][0][1],
                     "expert_points": gpu["expert"], "predict_layer_s": one["predict"],
                     "commit_route_s": one["commit_route"], "context_points": ctx,
                     **{k: one[k] for k in ("split_point", "context_caches", "load_queue", "load_copy", "copy_slow") if one.get(k)},
                     **({"launch_copy_points": gpu["launch_copy"]} if gpu["launch_copy"] else {}),
                     "readback_gpu_s": max(float(np.median([x for _, x in gpu["readback"]])), 0.0) if gpu["readback"] else 0.0,
                     "predict_gpu_s": max(one.get("predict_gpu", 0.0), 0.0), "commit_gpu_s": one.get("commit_gpu", 0.0),
                     "commit_gpu_copy_s": one.get("commit_gpu_copy", 0.0), "readback_copy_s": one.get("readback_copy", 0.0),
                     "launch_copy_s": one.get("launch_copy", 0.0),
                     **({"start_copy_s": max(one["start_copy"], 0.0)} if one.get("start_copy") is not None else {}),
                     "commit_start_excess_s": one.get("commit_start", 0.0),
                     "host": fig | {"load_s": one["host_load"], "route_waits": host["waits"], **r.wake}
                     | ({"loading_pass_start_samples": one["loading_starts"]} if one.get("loading_starts") else {})
                     | ({"pass_gap_s": gap} if gap is not None else {})},
           "waves": gpu["waves"], "commit_waves": r.one.get("commit_waves", []), "seconds": r.seconds,
           "repeats": {"host, layer": {"unit": "tokens", "grows": False, "points": host["layer_runs"]},
                       # shown with their spread, not judged: on the H200 the host's own speed moved
                       # 2x within minutes, which would call nearly every calibration noisy
                       "host, route": {"unit": "tokens", "grows": False, "judged": False,
                                       "points": host["route_runs"]},
                       "host, one expert": {"unit": "tokens", "grows": False, "judged": False,
                                            "points": host["expert_runs"]},
                       "host, pass start": {"unit": "tokens", "grows": False, "judged": False, "points": starts},
                       "host, LM head": {"unit": "tokens", "grows": False, "judged": False,
                                         "points": [[b, [x["head"] for x in v]] for b, v in sorted(r.host_runs.items())]},
                       "layer, context": {"unit": "keys", "grows": False, "judged": False,
                                               "points": r.one.get("context_runs", [])},
                       # one mean per batch: no spread, but 8 rows may not take less than 1
                       "expert in model": {"unit": "tokens", "grows": True,
                                           "points": [[t, [x]] for t, x in gpu["expert"]]}}}
    if r.py_runs:                 # the Python step's, and its runs shown with their spread, not judged
        out["layer"]["host_python"], rep = _python_host(r)
        out["repeats"] |= rep
    if r.cpu_pts:
        out |= cpu_in_model(r.cpu_pts, r.trips, r.cpu_steps, r.cpu_runs) | {"cpu_huge_pages": r.cpu_pages}
    return out
