"""`cmoe validate`: hold a predicted run (simulator) against a measured one (executor) of the
same trace, model, policy, pool and batch, and say how far apart they are and where.

Both folders are what `cmoe simulate --out` and `cmoe execute --out` write. Only the passes both
ran are compared (an executor run usually covers the first requests of a trace), decode passes
only, since tokens/s and time per token are decode figures. Errors are relative to the
measurement: signed error = (predicted - measured) / measured, so for times a positive bias means
the simulator is too slow, and for tokens/s that it is too fast; MAPE is the mean of its absolute
value.

- **op kinds**: spans matched by (pass, layer, expert) for `expert`, `load` and `cpu_expert`, and
  by (pass, layer) for everything else the compute stream does outside the experts (attention,
  dense and shared MLPs, routing, LM head: the engines split these differently, so they are
  compared as one kind, `non-expert`);
- **per layer**: wall time on the compute stream from the end of the previous layer's last span
  to the end of this layer's, stalls included: MAPE over (pass, layer) pairs, which also counts
  pass-to-pass jitter no model predicts, and the error of each layer's mean time over the passes
  (the worst layer's is `per_layer_mean_error_max`);
- **per token**: decode pass latency; **end to end**: tokens over time for all compared passes;
- **attribution**: the mean decode pass split into non-expert compute, expert compute and the
  rest (waiting for loads or CPU experts, gaps); the part with the largest difference is where
  the error comes from.
Numpy and pyarrow only, so it runs anywhere the timelines can be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cmoe.core.cpu_ref import cpu_ref_line
from cmoe.core.errors import CmoeError
from cmoe.analysis.cpu_settings import setting_notes, omp_note  # noqa: F401  (omp_note re-exported)
from cmoe.analysis.runfolder import read_metrics, read_passes, read_timeline
from cmoe.analysis.states import SLOW_SHARE, host_line, slow_host, two_states
from cmoe.core.timeline import STEP, LAYER, STREAM, OP, EXPERT, START, END, BYTES

NON_EXPERT = {"attention", "dense", "shared", "route", "head"}
KINDS = ("non-expert", "expert", "load", "cpu_expert")


@dataclass(frozen=True)
class Run:
    folder: Path
    metrics: dict
    spans: list
    passes: list[dict]


def read_run(folder: Path, policy: str) -> Run:
    metrics = read_metrics(folder)
    m = next((x for x in metrics if x["policy"] == policy), None)
    if m is None:
        raise CmoeError(f"{folder} has no run of policy {policy} (it has {', '.join(x['policy'] for x in metrics)})")
    return Run(folder, m, read_timeline(folder, policy), read_passes(folder, policy, required=True))


def check_same_setup(pred: Run, meas: Run) -> None:
    a, b = pred.metrics, meas.metrics
    if b.get("trace_id") is None:
        raise CmoeError(f"{meas.folder} used live routing: execute with --trace (the simulated trace) to validate")
    for key, what in (("model", "model"), ("policy", "policy"), ("trace_id", "trace"), ("batch", "batch"),
                      ("experts_fit", "pool layout (expert slots)")):
        if a.get(key) != b.get(key):
            hint = (": simulate with the executor's recipe (e.g. --quant w4g128,attention=bf16) or execute "
                    "with --policy-json from the simulation") if key == "experts_fit" else ""
            raise CmoeError(f"the runs differ in {what}: predicted {a.get(key)}, measured {b.get(key)}{hint}")


def _errors(pred: np.ndarray, meas: np.ndarray) -> dict:
    ok = meas > 0
    if not ok.any():
        return {"n": 0, "mape": float("nan"), "signed": float("nan")}
    rel = (pred[ok] - meas[ok]) / meas[ok]
    return {"n": int(ok.sum()), "mape": float(np.abs(rel).mean()), "signed": float(rel.mean()),
            "pred_mean_us": float(pred[ok].mean()), "meas_mean_us": float(meas[ok].mean())}


def _keyed(spans, steps: set[int]) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {k: {} for k in KINDS}
    for s in spans:
        step, layer, op, expert, dur = s[STEP], s[LAYER], s[OP], s[EXPERT], s[END] - s[START]
        if step not in steps:
            continue
        if op in NON_EXPERT:
            key, kind = (step, layer), "non-expert"
        elif op in ("expert", "load", "cpu_expert"):
            key, kind = (step, layer, expert), op
        else:
            continue
        out[kind][key] = out[kind].get(key, 0.0) + dur
    return out


def layer_times(spans, steps: set[int]) -> dict[tuple[int, int], float]:
    """(pass, layer) -> compute-stream wall time of that layer, stalls included."""
    by_step: dict[int, list] = {}
    for s in spans:
        if s[STEP] in steps and s[STREAM] == "compute" and s[LAYER] >= 0:
            by_step.setdefault(s[STEP], []).append(s)
    out = {}
    for step, ss in by_step.items():
        t = min(s[START] for s in ss)
        for layer in sorted({s[LAYER] for s in ss}):
            end = max(s[END] for s in ss if s[LAYER] == layer)
            out[(step, layer)] = end - t
            t = end
    return out


def _components(run: Run, steps: set[int]) -> dict[str, float]:
    """Mean decode pass split into non-expert compute, expert compute and the rest (us)."""
    lat = {p["pass"]: p["us"] for p in run.passes if p["pass"] in steps}
    ne = sum(s[END] - s[START] for s in run.spans if s[STEP] in steps and s[STREAM] == "compute" and s[OP] in NON_EXPERT)
    ex = sum(s[END] - s[START] for s in run.spans if s[STEP] in steps and s[OP] == "expert")
    n = max(len(lat), 1)
    total = sum(lat.values())
    return {"non-expert compute": ne / n, "expert compute": ex / n, "waits and gaps": (total - ne - ex) / n,
            "pass": total / n}


def host_layer_us(spans, steps: set[int]) -> float | None:
    """How fast the run's host was, per decoder layer, as calibrate's `host_layer` measures it: the
    `host_attention` spans of `steps` (each covers its MoE layer and the dense layers before it)
    less the `host_predict` spans inside them (an eager early router; calibrate's runs predict
    nothing), over the decoder layers they cover, the first MoE layer's left out (its span carries
    the pass's start). None without a host lane."""
    att = sorted((s[START], s[END], s[LAYER]) for s in spans if s[OP] == "host_attention" and s[STEP] in steps)
    if not att:
        return None
    pred = sorted((s[START], s[END]) for s in spans if s[OP] == "host_predict" and s[STEP] in steps)
    p0 = np.array([a for a, _ in pred])
    pdur = np.cumsum([0.0] + [b - a for a, b in pred])
    layers = sorted({d for _, _, d in att})
    covers = {d: d - prev for prev, d in zip(layers, layers[1:])}      # decoder layers since the last MoE one
    busy = n = 0.0
    for a, b, d in att:
        if d == layers[0]:
            continue
        lo, hi = np.searchsorted(p0, a), np.searchsorted(p0, b)      # predict spans that start inside
        busy += (b - a) - (pdur[hi] - pdur[lo])
        n += covers[d]
    return float(busy / n) if n else None


def link_gbps(spans, steps: set[int]) -> float | None:
    """The rate the run's expert loads moved at over the link, GB/s: their bytes over their summed
    time on the copy stream, in the passes `steps`. None where the passes loaded nothing. Beside a
    prediction's own, it says how fast the link ran against its calibration: on the H200 (tenth
    session) runs of one session moved loads at 51.0-55.4 GB/s, in spells of seconds."""
    loads = _loads(spans, steps)
    us = sum(s[END] - s[START] for s in loads)
    return sum(s[BYTES] for s in loads) / us / 1e3 if us else None


def _loads(spans, steps: set[int]) -> list:
    """The run's expert loads in the passes `steps` that moved bytes over some time."""
    return [s for s in spans if s[OP] == "load" and s[STEP] in steps and s[BYTES] > 0 and s[END] > s[START]]


SLOW_LOAD = 0.8   # a load that moved at under this share of the predicted link rate is the link's slow tail


def slow_loads(spans, steps: set[int], gbps: float | None) -> float | None:
    """The share of the run's loads in the passes `steps` that moved at under `SLOW_LOAD` of `gbps`
    (the prediction's link rate); None where it loaded nothing or `gbps` is unknown. A lent H100
    (twenty-third session) ran every run's median load at 54 GB/s as calibrated, while 5-13% of its
    loads moved at 35-45 GB/s on one host and none on another: a tail the calibration's best-of
    repeats did not meet, which `link_ratio` shows as 0.87-0.97x."""
    rates = [s[BYTES] / (s[END] - s[START]) / 1e3 for s in _loads(spans, steps)]
    return sum(r < SLOW_LOAD * gbps for r in rates) / len(rates) if rates and gbps else None


def link_ratio(v: dict) -> float | None:
    """One validation's measured link rate over its predicted one (`link_gbps`); None where either
    run loaded nothing."""
    g = v.get("link_gbps") or {}
    return g["measured"] / g["predicted"] if g.get("measured") and g.get("predicted") else None


CPU_NOTE = 0.05     # CPU experts this far off their calibration get a line of their own


def slow_cpu(pred: dict, meas: dict) -> dict | None:
    """The CPU experts both runs ran (`_keyed`'s, by pass, layer and expert), each one's measured
    over predicted time, in two groups (`cmoe.analysis.states.two_states`): the slower group's
    share and its median over the faster's (`factor`), the share 0 where the groups are under
    `SLOW_FACTOR` apart or split under `SEPARATION` of the variance (a floor since the fiftieth
    session: one wide state had read as two; of the d20cc85 CPU-expert validation's 18 runs the
    rule without it named 6, with it 1); None under 8 experts.

    Why: on the lent GPUs' hosts a run's CPU experts ran in two states, ~1.0-1.2 and ~1.6-2.0 ms a
    one-token expert, switching within a run (often slow at its start) while other processes and
    the hypervisor took next to no cores (thirtieth session, `cmoe.calibrate.host_load`). A
    calibration prices one state; a miss from this reads as the host's, not the model's. A drift
    over the run (1.25 ms down to 1.02) reads as one state, and a run slow throughout shows in its
    mean (`cpu_ratio`), not here. Measured over predicted, not raw times, so an expert's tokens
    and its idle before it, which the prediction prices, cancel out."""
    keys = [k for k in sorted(set(pred) & set(meas)) if pred[k] > 0 and meas[k] > 0]
    got = two_states([meas[k] / pred[k] for k in keys])
    return None if got is None else got[0]


def cpu_ratio(v: dict) -> float | None:
    """One validation's measured CPU expert time over its predicted one (the mean over the CPU
    experts both ran); None where none did."""
    e = (v.get("op_kinds") or {}).get("cpu_expert") or {}
    return e["meas_mean_us"] / e["pred_mean_us"] if e.get("n") and e.get("pred_mean_us") else None


def validate(pred: Run, meas: Run) -> dict:
    check_same_setup(pred, meas)
    dp = {p["pass"]: p for p in pred.passes if p["decode"]}
    dm = {p["pass"]: p for p in meas.passes if p["decode"]}
    steps = set(dp) & set(dm)
    if not steps:
        raise CmoeError("the runs share no decode pass: execute at least one decode token of the same trace")
    kp, km = _keyed(pred.spans, steps), _keyed(meas.spans, steps)
    kinds = {}
    for k in KINDS:
        both = sorted(set(kp[k]) & set(km[k]))
        if both or kp[k] or km[k]:
            e = _errors(np.array([kp[k][x] for x in both]), np.array([km[k][x] for x in both]))
            e.update(only_predicted=len(set(kp[k]) - set(km[k])), only_measured=len(set(km[k]) - set(kp[k])))
            kinds[k] = e
    lp, lm = layer_times(pred.spans, steps), layer_times(meas.spans, steps)
    layers = {}
    for layer in sorted({l for _, l in set(lp) & set(lm)}):
        keys = sorted(k for k in set(lp) & set(lm) if k[1] == layer)
        layers[layer] = _errors(np.array([lp[k] for k in keys]), np.array([lm[k] for k in keys]))
        e = layers[layer]
        # the layer's mean time over the passes: what a model can predict (MAPE also counts jitter)
        e["mean_error"] = (e["pred_mean_us"] - e["meas_mean_us"]) / e["meas_mean_us"] if e["n"] else float("nan")
    order = sorted(steps)
    tok = _errors(np.array([dp[s]["us"] for s in order]), np.array([dm[s]["us"] for s in order]))
    tp = sum(dp[s]["tokens"] for s in order) / sum(dp[s]["us"] for s in order) * 1e6
    tm = sum(dm[s]["tokens"] for s in order) / sum(dm[s]["us"] for s in order) * 1e6
    cp, cm = _components(pred, steps), _components(meas, steps)
    diffs = {k: cp[k] - cm[k] for k in cp if k != "pass"}
    worst = max(diffs, key=lambda k: abs(diffs[k]))
    layer_mape = [v["mape"] for v in layers.values() if v["n"]]
    scored = [k for k, v in layers.items() if v["n"]]
    worst_of = lambda ks: max(ks, key=lambda k: abs(layers[k]["mean_error"]), default=None)  # noqa: E731
    worst_layer = worst_of(scored)
    # past the first layer, whose span holds the host's pass boundary (issue 15's misses, twenty-fourth session)
    first = min(layers, default=None)
    rest = worst_of([k for k in scored if k != first])
    return {"policy": pred.metrics["policy"], "model": pred.metrics["model"], "trace_id": pred.metrics["trace_id"],
            "decode_passes": len(order), "tokens_per_s": {"predicted": tp, "measured": tm, "error": (tp - tm) / tm},
            "per_token": tok, "op_kinds": kinds, "per_layer": layers,
            "per_layer_mape_mean": float(np.mean(layer_mape)) if layer_mape else float("nan"),
            "per_layer_mape_max": float(np.max(layer_mape)) if layer_mape else float("nan"),
            "per_layer_mean_error_max": layers[worst_layer]["mean_error"] if worst_layer is not None else float("nan"),
            "per_layer_worst": worst_layer,
            "per_layer_mean_error_max_rest": layers[rest]["mean_error"] if rest is not None else float("nan"),
            "components_us": {"predicted": cp, "measured": cm, "difference": diffs}, "error_from": worst,
            "host_layer_us": host_layer_us(meas.spans, steps),
            # whether the run's host program planned it (None: not recorded), which host costs it ran at
            "host_program": meas.metrics.get("host_program"),
            "link_gbps": {"predicted": (g := link_gbps(pred.spans, steps)), "measured": link_gbps(meas.spans, steps)},
            "slow_loads": slow_loads(meas.spans, steps, g), "slow_cpu": slow_cpu(kp["cpu_expert"], km["cpu_expert"]),
            "slow_host": slow_host(meas.spans, steps, dp, dm),
            # OpenMP settings (wait policy, a binding) of the profile's CPU experts and the runs' (None: unrecorded)
            "omp_wait": {"profile": pred.metrics.get("omp_wait_policy"), "runs": meas.metrics.get("omp_wait_policy")},
            "cpu_pages": {"profile": pred.metrics.get("cpu_pages"), "runs": meas.metrics.get("cpu_pages")},
            # the few-expert switch calibrate and the runs ran under (`cmoe.executor.few_experts`; no line
            # says where they differ: the launch fit comes from upper's launches, which never switch)
            "few_experts": {"profile": pred.metrics.get("few_experts"), "runs": meas.metrics.get("few_experts"),
                            "batch": meas.metrics.get("batch")},    # and the CPU's plain loop (`cmoe.core.cpu_ref`)
            "cpu_ref_us": {"profile": pred.metrics.get("cpu_ref_us"), "runs": meas.metrics.get("cpu_ref_us")}}


def format_validation(v: dict) -> str:
    t = v["tokens_per_s"]
    lines = [f"{v['policy']} on {v['model']} (trace {v['trace_id']}), {v['decode_passes']} decode passes compared",
             f"  end to end: predicted {t['predicted']:.1f} tok/s, measured {t['measured']:.1f} tok/s, "
             f"error {t['error'] * 100:+.1f}%",
             f"  per token:  MAPE {v['per_token']['mape'] * 100:.1f}%, signed {v['per_token']['signed'] * 100:+.1f}%",
             f"  per layer:  MAPE mean {v['per_layer_mape_mean'] * 100:.1f}%, worst {v['per_layer_mape_max'] * 100:.1f}%; "
             f"mean time, worst layer {v['per_layer_mean_error_max'] * 100:+.1f}%"
             + (f" (layer {v['per_layer_worst']})" if v.get("per_layer_worst") is not None else ""),
             f"  {'op kind':<12} {'matched':>8} {'pred us':>9} {'meas us':>9} {'MAPE':>7} {'signed':>8} {'unmatched':>10}"]
    for k, e in v["op_kinds"].items():
        if e["n"]:
            lines.append(f"  {k:<12} {e['n']:8d} {e['pred_mean_us']:9.1f} {e['meas_mean_us']:9.1f} "
                         f"{e['mape'] * 100:6.1f}% {e['signed'] * 100:+7.1f}% {e['only_predicted'] + e['only_measured']:10d}")
        else:
            lines.append(f"  {k:<12} {0:8d} {'-':>9} {'-':>9} {'-':>7} {'-':>8} {e['only_predicted'] + e['only_measured']:10d}")
    c = v["components_us"]
    parts = ", ".join(f"{k} {c['predicted'][k] / 1e3:.2f} vs {c['measured'][k] / 1e3:.2f} ms"
                      for k in c["difference"])
    lines.append(f"  mean decode pass, predicted vs measured: {parts}")
    lines.append(f"  the error comes mostly from {v['error_from']} "
                 f"({c['difference'][v['error_from']] / 1e3:+.2f} ms per pass)")
    if (k := link_ratio(v)) is not None:
        g = v["link_gbps"]
        lines.append(f"  loads moved at {g['measured']:.1f} GB/s measured, {g['predicted']:.1f} predicted "
                     f"(the link at {k:.3f}x its calibration; {v.get('slow_loads') or 0.0:.0%} of the loads "
                     f"under {SLOW_LOAD:.0%} of its rate)")
    sc = v.get("slow_cpu") or {"share": 0.0}
    if (k := cpu_ratio(v)) is not None and (abs(k - 1) > CPU_NOTE or sc["share"] >= SLOW_SHARE):
        two = (f"; {sc['share']:.0%} of them ran {sc['factor']:.2f}x slower than the rest, the host's CPU in "
               "a slow state for part of the run" if sc["share"] >= SLOW_SHARE else "")
        lines.append(f"  CPU experts ran {k:.2f}x their calibrated time{two}: a lent GPU's host ran them in two "
                     "states, switching within runs; repeat the runs (cmoe run --repeat N) to see it")
    return "\n".join(lines + [x for x in [host_line(v), cpu_ref_line(v)] if x] + setting_notes(v))


def validate_folders(predicted: Path, measured: Path, policies: list[str] | None = None) -> list[dict]:
    if not (measured / "metrics.json").is_file():
        raise CmoeError(f"{measured} has no metrics.json: give the folder written by cmoe execute --out")
    names = policies or [m["policy"] for m in read_metrics(measured)]
    return [validate(read_run(predicted, p), read_run(measured, p)) for p in names]


LAYER_TOL = 0.08           # issue 15: every layer's mean time within 8%


def layer_repeats(vs: list[dict], tol: float = LAYER_TOL) -> dict:
    """Per layer present in every measured run `vs` of one prediction: its predicted mean time's
    error against the runs' mean, and the runs' own spread ((max - min) / mean); the worst layer by
    error; and `within`: whether every layer is within `tol` of the runs' mean or inside the runs'
    own range widened by `tol` (a prediction between two runs of one configuration is as close as
    the machine lets a model come; one below or above them all is not, however far apart they
    are). None where the runs share no layer."""
    common = set.intersection(*[{k for k, e in v["per_layer"].items() if e["n"]} for v in vs]) if vs else set()
    out, inside = {}, []
    for k in sorted(common):
        meas = [v["per_layer"][k]["meas_mean_us"] for v in vs]
        mean, pred = sum(meas) / len(meas), vs[0]["per_layer"][k]["pred_mean_us"]
        out[k] = {"error": pred / mean - 1, "spread": (max(meas) - min(meas)) / mean}
        inside.append(abs(out[k]["error"]) <= tol or min(meas) * (1 - tol) <= pred <= max(meas) * (1 + tol))
    worst = max(out, key=lambda k: abs(out[k]["error"]), default=None)
    return {"layers": out, "worst": worst, "within": all(inside) if inside else None}


def against_repeats(runs: list[list[dict]]) -> list[dict]:
    """The same prediction held against several measured runs of one configuration (each a
    `validate_folders` result, policies in the same order): tokens/s error against the runs' mean,
    and the runs' own spread ((max - min) / mean); per layer the same (`layer_repeats`). Where the
    spread is as large as the error, the machine's noise, not the model, decides the figure."""
    if any([v["policy"] for v in r] != [v["policy"] for v in runs[0]] for r in runs):
        raise CmoeError("the measured folders hold different policies: give runs of the same configuration")
    out = []
    for vs in zip(*runs):
        meas = [v["tokens_per_s"]["measured"] for v in vs]
        mean = sum(meas) / len(meas)
        pred = vs[0]["tokens_per_s"]["predicted"]
        out.append({"policy": vs[0]["policy"], "predicted": pred, "measured": meas, "error": pred / mean - 1,
                    "spread": (max(meas) - min(meas)) / mean,
                    "per_layer_mean_error_max": [v["per_layer_mean_error_max"] for v in vs],
                    "per_layer_mean_error_max_rest": [v.get("per_layer_mean_error_max_rest", float("nan")) for v in vs],
                    "per_layer_repeats": layer_repeats(vs)})
    return out


def format_repeats(rows: list[dict]) -> str:
    lines = [f"{'policy':<14} {'predicted':>10} {'measured tok/s':>22} {'error':>8} {'spread':>7}  worst layer"]
    for r in rows:
        meas = " / ".join(f"{x:.1f}" for x in r["measured"])
        lr = r["per_layer_repeats"]
        w = lr["worst"]
        worst = (f"  layer {w} {lr['layers'][w]['error'] * 100:+.1f}%, runs {lr['layers'][w]['spread'] * 100:.1f}% apart"
                 if w is not None else "")
        lines.append(f"{r['policy']:<14} {r['predicted']:10.1f} {meas:>22} {r['error'] * 100:+7.1f}% "
                     f"{r['spread'] * 100:6.1f}%{worst}")
    return "\n".join(lines)


def calibrations_agree(rows: list[dict], key: str = "other_profile_tok_s", tol: float = 0.02) -> tuple[int, list]:
    """Issue 15's second condition, over a validation table's rows that carry a second
    calibration's prediction under `key` beside their own (`predicted_tok_s`): how many the two
    predict within `tol` of each other (relative to the first), and every row beyond it as
    (pool, batch, policy, relative difference), largest first."""
    diffs = [(r["pool_gb"], r["batch"], r["policy"], r[key] / r["predicted_tok_s"] - 1)
             for r in rows if key in r and r["predicted_tok_s"] > 0]
    beyond = sorted((d for d in diffs if abs(d[3]) > tol), key=lambda d: -abs(d[3]))
    return len(diffs) - len(beyond), beyond
