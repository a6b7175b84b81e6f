"""`cmoe report`: one self-contained HTML file from a simulation, an execution, a sweep, or a
predicted/measured pair. Plotly's script is embedded once, so the page works offline.

Inputs it recognises:
- a folder written by `cmoe simulate --out` or `cmoe execute --out` (metrics.json,
  timeline-POLICY.parquet, passes-POLICY.json): metrics table, policies side by side, where a
  decode pass's time goes, misses by layer and expert, the timeline;
  with `quality` (the JSON `cmoe quality --out` writes), also the frontier: tokens/s against KL to
  exact routing (`cmoe.report.frontier`);
- a sweep table (`cmoe sweep --out X.parquet`): tokens/s against pool size per policy;
- any timeline Parquet: the timeline alone;
- two folders, predicted then measured: each policy's error over its whole run, over the passes
  both ran and over the host lane's fast passes (`cmoe.analysis.states`), each layer's mean time
  predicted against measured (a scatter), each decode pass's measured time over its predicted one
  (the host's slow passes open), both timelines on one time axis per policy, and a table of where
  their times differ (by op, per decode pass);
- a trace bundle folder (`cmoe trace --out`): its statistics (`cmoe stats`) as a page.

Every time on a page is in milliseconds.
"""

from __future__ import annotations

import html
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.analysis.runfolder import read_metrics, read_passes, read_timeline, read_timeline_file
from cmoe.core.timeline import STEP, LAYER, OP, EXPERT, START, END, BYTES, COLUMNS
from cmoe.core.util import write_text_atomic
from cmoe.report.page import Figures

MAX_SPANS = 100_000
# What a report reads of every policy's metrics: a run's table, and a predicted/measured comparison.
RUN_METRICS = ("model", "pool_gb", "batch", "decode_tokens", "tokens_per_s", "tpot_ms_mean", "tpot_ms_p99",
               "hit_rate", "loads", "bytes_moved", "fallbacks", "skipped", "experts_fit")
COMPARE_METRICS = ("model", "tokens_per_s", "tpot_ms_mean")
_CSS = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;"
        "font-size:13px;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.note{color:#555;font-size:13px}")


def _page(title: str, blocks: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{''.join(blocks)}</body></html>")


def _table(header: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _metrics_table(metrics: list[dict]) -> str:
    up = next((m["tokens_per_s"] for m in metrics if m["policy"] == "upper"), None)
    rows = [[m["policy"], f"{m['tokens_per_s']:.1f}", f"{m['tokens_per_s'] / up:.2f}" if up else "-",
             f"{m['tpot_ms_mean']:.2f}", f"{m['tpot_ms_p99']:.2f}", f"{m['hit_rate']:.3f}", m["loads"],
             f"{m['bytes_moved'] / 1e9:.2f}", m["fallbacks"], m["skipped"], m["experts_fit"]] for m in metrics]
    return _table(["policy", "tokens/s", "x upper", "TPOT ms", "p99 ms", "hit", "loads", "GB moved", "fallback",
                   "skipped", "slots"], rows)


def _read_run(folder: Path, need: tuple[str, ...]) -> tuple[list[dict], dict[str, list], dict[str, list[dict]]]:
    metrics = read_metrics(folder, need)
    spans = {m["policy"]: read_timeline(folder, m["policy"]) for m in metrics}
    passes = {m["policy"]: read_passes(folder, m["policy"], required=False) for m in metrics}
    return metrics, spans, passes


def _kind(metrics: list[dict]) -> str:
    return "measured" if metrics and "source" in metrics[0] else "predicted"


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _frontier_block(metrics: list[dict], quality: Path, figs: Figures) -> str:
    """The frontier section: the figure, its table beside it, and notes on what the KL is."""
    from cmoe.report.frontier import MEASURED_WITH, frontier_data, frontier_figure, read_quality
    doc = read_quality(quality)
    f = frontier_data(metrics, doc)
    rows = [[p["policy"], f"{p['tokens_per_s']:.1f}", _fmt(p["x_oracle"], ".2f"), _fmt(p["kl"], ".4f", "not measured"),
             _fmt(p["top1"], ".3f", "not measured")] for p in f.points]
    table = _table(["policy", "tok/s", "x oracle", "KL nats", "top-1 agree"], rows)
    notes = [f"KL: mean over positions of KL(exact || policy) in nats, and top-1 agreement, from {quality} "
             f"(model {doc.get('model', '?')}, {doc.get('tokens', '?')} positions, teacher-forced); policies that "
             f"never skip a routed expert are at KL 0 and agreement 1 by construction. cmoe quality measures "
             + "; ".join(f"{p} with {w}" for p, w in MEASURED_WITH.items()) + f". Tokens/s: this run ({metrics[0]['model']})."]
    if f.lines:
        notes.append("dashed: " + ", ".join(f"{n} at {y:.1f} tok/s" for n, y in f.lines.items()) + ".")
    if f.unmeasured:
        fix = [p for p in f.unmeasured if p in MEASURED_WITH]
        notes.append(f"not drawn (not measured, never put at KL 0): {', '.join(f.unmeasured)}; {quality} has no "
                     f"row for them" + (f": run cmoe quality --variants {','.join(fix)} --out FILE" if fix else "") + ".")
    # the table first: plotly sizes the figure to its column as it draws, so the table must be there by then
    return ("<h2>Frontier: tokens/s against KL to exact routing</h2><div style='display:grid;gap:16px;"
            f"grid-template-columns:auto minmax(0,1fr);align-items:start'><div>{table}</div>"
            f"<div>{figs.div(frontier_figure(f))}</div></div>" + "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes))


def _decode_steps(passes: list[dict], spans: list) -> set[int]:
    """The decode passes: from passes-POLICY.json, else every pass but the first (the prefill)."""
    if passes:
        return {p["pass"] for p in passes if p["decode"]}
    return {s[STEP] for s in spans} - {min((s[STEP] for s in spans), default=0)}


def _summary_blocks(metrics: list[dict], spans: dict[str, list], passes: dict[str, list[dict]], figs: Figures) -> list[str]:
    """Policies side by side, where a decode pass's time goes, and which experts miss."""
    from cmoe.analysis.breakdown import expert_traffic, pass_breakdown
    from cmoe.report.charts import breakdown_figure, policy_bars, traffic_figure
    decode = {p: _decode_steps(passes.get(p) or [], spans[p]) for p in spans}
    latency = {p: {r["pass"]: r["us"] for r in passes.get(p) or []} or None for p in spans}
    rows = [(m["policy"], pass_breakdown(spans[m["policy"]], decode[m["policy"]], latency[m["policy"]])) for m in metrics]
    traffic = [(m["policy"], expert_traffic(spans[m["policy"]], decode[m["policy"]]), len(decode[m["policy"]]))
               for m in metrics if m["policy"] != "upper"]
    blocks = ["<h2>Policies side by side</h2>", figs.div(policy_bars(metrics)),
              "<h2>Where a decode pass's time goes</h2>",
              "<p class='note'>The compute stream's time per decode pass: busy with experts or with the rest of "
              "the layer; idle while a copy was in flight, else while CPU experts ran, else waiting on the host "
              "(cmoe/analysis/breakdown.py). The parts add up to the mean TPOT.</p>", figs.div(breakdown_figure(rows))]
    keys = {k for _, t, _ in traffic for k in t} | {(s[LAYER], s[EXPERT]) for p in spans for s in spans[p]
                                                    if s[OP] == "expert" and s[EXPERT] >= 0}
    if traffic and keys:
        layers = sorted({m for m, _ in keys})
        blocks += ["<h2>Misses by layer and expert</h2>",
                   "<p class='note'>Copies into the pool plus runs on the CPU, per decode pass (the menu picks the "
                   "policy; hover for how often each expert ran).</p>",
                   figs.div(traffic_figure(traffic, layers, max(e for _, e in keys) + 1))]
    return blocks


def run_report(folder: Path, max_spans: int, quality: Path | None = None) -> tuple[str, str]:
    from cmoe.report.figures import limit_spans, timeline_figure
    metrics, spans, passes = _read_run(folder, RUN_METRICS)
    kind = _kind(metrics)
    m0 = metrics[0]
    title = f"{m0['model']}: {kind}, pool {m0['pool_gb']:g} GB, batch {m0['batch']}"
    figs = Figures()
    groups, note = limit_spans([(p, spans[p]) for p in spans], max_spans)
    blocks = [f"<p class='note'>{html.escape(kind)} run from {html.escape(str(folder))}; "
              f"{m0['decode_tokens']} decode tokens per policy.</p>", _metrics_table(metrics),
              _frontier_block(metrics, quality, figs) if quality is not None else "",
              *_summary_blocks(metrics, spans, passes, figs),
              "<h2>Timeline</h2>", f"<p class='note'>{html.escape(note)}</p>" if note else "",
              figs.div(timeline_figure(groups, f"{kind} timeline"))]
    return title, "".join(blocks)


def compare_report(predicted: Path, measured: Path, max_spans: int) -> tuple[str, str]:
    from cmoe.report.figures import limit_spans, timeline_figure
    pm, ps, ppasses = _read_run(predicted, COMPARE_METRICS)
    mm, ms, mpasses = _read_run(measured, COMPARE_METRICS)
    common = [m["policy"] for m in mm if m["policy"] in ps]
    if not common:
        raise CmoeError(f"{predicted} and {measured} share no policy: run the same policies in both")
    figs = Figures()
    vals, why = _validations((predicted, pm, ps, ppasses), (measured, mm, ms, mpasses), common)
    blocks = [f"<p class='note'>predicted: {html.escape(str(predicted))}; measured: {html.escape(str(measured))}</p>"]
    rows = []
    for pol in common:
        a = next(m for m in pm if m["policy"] == pol)
        b = next(m for m in mm if m["policy"] == pol)
        err = (a["tokens_per_s"] - b["tokens_per_s"]) / b["tokens_per_s"] * 100 if b["tokens_per_s"] else float("nan")
        rows.append([pol, f"{a['tokens_per_s']:.1f}", f"{b['tokens_per_s']:.1f}", f"{err:+.1f}%", *_state_cells(vals.get(pol)),
                     f"{a['tpot_ms_mean']:.2f}", f"{b['tpot_ms_mean']:.2f}"])
    blocks.append(_table(["policy", "predicted tok/s", "measured tok/s", "error", "error, the passes both ran",
                          "error, the host's fast passes", "predicted TPOT ms", "measured TPOT ms"], rows))
    blocks += _layer_block(vals, why, ppasses, mpasses, figs)
    for pol in common:
        pred, meas = _aligned(ps[pol], ms[pol])
        blocks.append(f"<h2>{html.escape(pol)}: time per decode pass by op</h2>")
        decode = {p["pass"] for p in mpasses.get(pol) or [] if p["decode"]}
        blocks.append(_op_table(pred, meas, decode or None))
        groups, note = limit_spans([(f"predicted {pol}", pred), (f"measured {pol}", meas)], max_spans)
        if note:
            blocks.append(f"<p class='note'>{html.escape(note)}</p>")
        blocks.append(figs.div(timeline_figure(groups, f"{pol}: predicted and measured")))
    return f"{pm[0]['model']}: predicted against measured", "".join(blocks)


def _state_cells(v: dict | None) -> list[str]:
    """A policy's validation in the table: its error over the decode passes both runs ran (the
    "error" column's run figures may cover more passes than the measured run did), and over those
    whose host lane ran in its fast state where it ran in two (`cmoe.analysis.states`); "n/a"
    where it could not be validated, "-" where its host ran in one state or has no lane."""
    if v is None:
        return ["n/a", "n/a"]
    sh = v.get("slow_host") or {}
    fast = f"{sh['fast_error'] * 100:+.1f}% ({sh['share']:.0%} slow)" if sh.get("share") else "-"
    return [f"{v['tokens_per_s']['error'] * 100:+.1f}%", fast]


def _validations(predicted: tuple, measured: tuple, policies: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Each policy's `cmoe validate` result, from what `_read_run` read already (folder, metrics,
    spans, passes of each side), and for each policy that cannot be validated why."""
    from cmoe.analysis.validate import Run, read_run, validate

    def run(side, pol):
        folder, metrics, spans, passes = side
        if not passes.get(pol):
            return read_run(folder, pol)                 # says in one line what is missing
        return Run(folder, next(m for m in metrics if m["policy"] == pol), spans[pol], passes[pol])
    vals, why = {}, {}
    for pol in policies:
        try:
            vals[pol] = validate(run(predicted, pol), run(measured, pol))
        except CmoeError as e:
            why[pol] = str(e)
    return vals, why


def _layer_block(vals: dict[str, dict], why: dict[str, str], ppasses: dict, mpasses: dict, figs: Figures) -> list[str]:
    """Each layer's mean time per decode pass, predicted against measured, as `cmoe validate` reads
    it, and each decode pass's measured time over its predicted one with the host's slow passes
    marked, for the policies validated; a note for each that was not (`why`)."""
    from cmoe.report.charts import layer_scatter, pass_ratio
    notes = [f"<p class='note'>no per-layer or per-pass comparison of {html.escape(p)}: {html.escape(w)}</p>"
             for p, w in why.items()]
    if not vals:
        return notes
    layers = [(pol, [(int(m), e["pred_mean_us"] / 1e3, e["meas_mean_us"] / 1e3) for m, e in v["per_layer"].items()
                     if e["n"]]) for pol, v in vals.items()]
    passes = []
    for pol, v in vals.items():
        slow = set((v.get("slow_host") or {}).get("slow_passes") or [])
        pred = {p["pass"]: p["us"] for p in ppasses[pol] if p["decode"]}
        passes.append((pol, [(p["pass"], p["us"] / pred[p["pass"]], p["pass"] in slow) for p in mpasses[pol]
                             if p["decode"] and pred.get(p["pass"])]))
    return notes + ["<h2>Each layer, predicted against measured</h2>", figs.div(layer_scatter(layers)),
                    "<h2>Each decode pass, measured over predicted</h2>", figs.div(pass_ratio(passes))]


def _aligned(pred: list, meas: list) -> tuple[list, list]:
    """The passes both runs have (a measured run often covers fewer), each shifted to start at 0."""
    steps = {s[STEP] for s in pred} & {s[STEP] for s in meas}

    def keep(spans):
        kept = [s for s in spans if s[STEP] in steps]
        t0 = min((s[START] for s in kept), default=0.0)
        return [s[:6] + (s[START] - t0, s[END] - t0, s[BYTES]) for s in kept]
    return keep(pred), keep(meas)


def _op_table(pred: list, meas: list, decode: set[int] | None) -> str:
    """Time per decode pass by op (`decode`: the decode passes; None: every pass with experts).
    The host thread's lane is measured only: the simulator models it but draws no spans for it."""
    dec = decode if decode else ({s[STEP] for s in meas if s[OP] == "expert"} or {s[STEP] for s in meas})

    def per_pass(spans):
        tot: dict[str, float] = {}
        for s in spans:
            if s[STEP] in dec:
                tot[s[OP]] = tot.get(s[OP], 0.0) + s[END] - s[START]
        return {k: v / max(len(dec), 1) / 1e3 for k, v in tot.items()}
    a, b = per_pass(pred), per_pass(meas)
    rows = []
    for op in sorted(set(a) | set(b)):
        x, y = a.get(op, 0.0), b.get(op, 0.0)
        if op.startswith("host_") and op not in a:
            rows.append([op, "-", f"{y:.3f}", "-"])
            continue
        rows.append([op, f"{x:.3f}", f"{y:.3f}", f"{(x - y) / y * 100:+.1f}%" if y else "-"])
    return _table(["op", "predicted ms", "measured ms", "error"], rows)


def sweep_report(path: Path) -> tuple[str, str]:
    import pyarrow.parquet as pq

    from cmoe.report.figures import sweep_figure
    try:
        table = pq.read_table(path)
    except Exception as e:                        # pyarrow raises several types for a bad file
        raise CmoeError(f"{path} could not be read ({type(e).__name__}): write it again") from None
    missing = {"trace", "profile", "batch", "policy", "pool_gb", "tokens_per_s", "error"} - set(table.schema.names)
    if missing:
        raise CmoeError(f"{path} is neither a timeline nor a sweep table (cmoe sweep --out): it lacks "
                        f"{', '.join(sorted(missing))}")
    rows = table.to_pylist()
    if not rows:
        raise CmoeError(f"{path} has no rows: give a sweep table with at least one grid point")
    figs = Figures()
    blocks = []
    for heading, fig in sweep_figure(rows):
        blocks += [f"<h2>{html.escape(heading)}</h2>", figs.div(fig)]
    bad = [r for r in rows if r["error"]]
    if bad:
        blocks.append(_table(["trace", "profile", "pool GB", "policy", "batch", "error"],
                             [[r["trace"], r["profile"], r["pool_gb"], r["policy"], r["batch"], r["error"]] for r in bad]))
    return f"sweep: {path.name}", "".join(blocks)


def timeline_report(path: Path, max_spans: int) -> tuple[str, str]:
    from cmoe.report.figures import limit_spans, timeline_figure
    groups, note = limit_spans([(path.stem, read_timeline_file(path))], max_spans)
    blocks = [f"<p class='note'>{html.escape(note)}</p>" if note else "", Figures().div(timeline_figure(groups, path.stem))]
    return f"timeline: {path.name}", "".join(blocks)


def _parquet_columns(path: Path) -> set[str]:
    import pyarrow.parquet as pq
    try:
        return set(pq.read_schema(path).names)
    except Exception as e:                        # pyarrow raises several types for a bad file
        raise CmoeError(f"{path} is not a readable Parquet file ({type(e).__name__})") from None


def _check_quality(inputs: list[Path], quality: Path) -> None:
    if len(inputs) != 1 or not inputs[0].is_dir():
        raise CmoeError("--quality goes with one run folder (cmoe simulate or execute --out), "
                        "not two folders, a sweep table or a timeline")
    if not quality.is_file():
        raise CmoeError(f"{quality} does not exist: pass --quality the JSON file that cmoe quality --out FILE writes")


def build_report(inputs: list[Path], out: Path | None = None, max_spans: int = MAX_SPANS,
                 quality: Path | None = None) -> Path:
    """`quality`: the JSON `cmoe quality --out` writes; with one run folder it adds the frontier."""
    if not 1 <= len(inputs) <= 2:
        raise CmoeError("give one run folder, sweep table or timeline, or two run folders (predicted, measured)")
    for p in inputs:
        if not p.exists():
            raise CmoeError(f"{p} does not exist")
    if quality is not None:
        _check_quality(inputs, quality)
    first = inputs[0]
    if len(inputs) == 2:
        title, body = compare_report(inputs[0], inputs[1], max_spans)
        out = out or inputs[1] / "compare.html"
    elif first.is_dir() and (first / "meta.json").is_file() and quality is None:
        from cmoe.report.stats_page import stats_report
        title, body = stats_report(first)
        out = out or first.parent / f"{first.name}-stats.html"         # beside the bundle, never inside it
    elif first.is_dir():
        title, body = run_report(first, max_spans, quality)
        out = out or first / "report.html"
    elif first.suffix == ".parquet":
        cols = _parquet_columns(first)
        if set(COLUMNS) <= cols:
            title, body = timeline_report(first, max_spans)
        else:
            title, body = sweep_report(first)
        out = out or first.with_suffix(".html")
    else:
        raise CmoeError(f"{first}: expected a run folder, a sweep or timeline .parquet file")
    return write_text_atomic(out, _page(title, [body]))


def report_line(inputs: list[Path], out: Path | None = None) -> str:
    """What simulate, sweep, execute, validate and run print about their report: where it is, or,
    on a machine without plotly (the GPU image has none), how to build it elsewhere. The command's
    own output is written by then, so a report that cannot be built is a note, not a failure."""
    import importlib.util
    if importlib.util.find_spec("plotly") is None:
        return f"no report here (plotly is not installed): run cmoe report {' '.join(map(str, inputs))} where it is"
    try:
        return f"report: {build_report(inputs, out)}"
    except CmoeError as e:
        return f"no report: {e}"
