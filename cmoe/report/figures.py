"""Plotly figures for reports: timelines and sweeps (the summary charts are in `charts.py`).

Timelines are drawn as WebGL line segments, one trace per (run, op): each span is two points and
a gap, so 100,000+ spans stay responsive where one SVG bar per span would not. The time axis is
numeric milliseconds, as on every chart of a report. Lanes are (run, stream) pairs; spans that overlap on one stream (copies in
flight together) go to extra lanes `copy0#1`, ... as in the Chrome trace export.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from cmoe.report.chrome import tracks
from cmoe.core.timeline import STEP, LAYER, OP, EXPERT, START, END, BYTES, Span

OP_COLORS = {"attention": "#4C78A8", "dense": "#9ECAE9", "shared": "#72B7B2", "route": "#B279A2",
             "expert": "#F58518", "head": "#54A24B", "load": "#E45756", "cpu_expert": "#9D755D",
             "roundtrip": "#BAB0AC",
             # the host thread's lane: lighter shades of what it issues
             "host_attention": "#A6C3DE", "host_sync": "#D8D8D8", "host_route": "#D6BCD0", "host_expert": "#FAC38C",
             "host_predict": "#EECA3B", "host_head": "#A9D4A5"}
POLICY_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#B279A2", "#9D755D", "#72B7B2", "#EECA3B"]
_HOVER = ("%{fullData.name}<br>pass %{customdata[0]}, layer %{customdata[1]}, expert %{customdata[2]}"
          "<br>%{customdata[3]:.2f} MB, %{customdata[4]:.4f} ms long<br>at %{x:.4f} ms<extra></extra>")


def limit_spans(groups: list[tuple[str, list[Span]]], max_spans: int) -> tuple[list[tuple[str, list[Span]]], str]:
    """Keep whole passes, from the first, until `max_spans` spans are shown in all. Returns the
    groups kept and a note saying what was left out ('' when nothing was)."""
    total = sum(len(s) for _, s in groups)
    if total <= max_spans:
        return groups, ""
    steps = sorted({s[STEP] for _, spans in groups for s in spans})
    counts: dict[int, int] = {}
    for _, spans in groups:
        for s in spans:
            counts[s[STEP]] = counts.get(s[STEP], 0) + 1
    kept, n = set(), 0
    for st in steps:
        if n + counts[st] > max_spans and kept:
            break
        kept.add(st)
        n += counts[st]
    out = [(label, [s for s in spans if s[STEP] in kept]) for label, spans in groups]
    return out, (f"showing passes {min(kept)}-{max(kept)} of {len(steps)} ({n:,} of {total:,} spans); "
                 f"raise --max-spans to see more")


def timeline_figure(groups: list[tuple[str, list[Span]]], title: str = "timeline") -> go.Figure:
    lanes: list[str] = []
    fig = go.Figure()
    for label, spans in groups:
        by_op: dict[str, list] = {}
        lane_of: dict[str, int] = {}
        for track, s in tracks(spans):
            if track not in lane_of:
                lane_of[track] = len(lanes)
                lanes.append(f"{label} | {track}")
            by_op.setdefault(s[OP], []).append((lane_of[track], s))
        for op, items in sorted(by_op.items()):
            n = len(items)
            x = np.full(3 * n, np.nan)                       # start, end, gap (ms): float64 keeps 0.1 us
            y = np.full(3 * n, np.nan, dtype=np.float32)
            cd = np.zeros((3 * n, 5), dtype=np.float32)      # pass, layer, expert, MB, duration ms
            x[0::3] = [s[START] / 1e3 for _, s in items]
            x[1::3] = [s[END] / 1e3 for _, s in items]
            y[0::3] = y[1::3] = [lane for lane, _ in items]
            info = np.array([(s[STEP], s[LAYER], s[EXPERT], s[BYTES] / 1e6, (s[END] - s[START]) / 1e3) for _, s in items], dtype=np.float32)
            cd[0::3], cd[1::3] = info, info
            fig.add_trace(go.Scattergl(
                x=x, y=y, customdata=cd, mode="lines", name=f"{label}: {op}", legendgroup=op,
                line=dict(color=OP_COLORS.get(op, "#333333"), width=9), hovertemplate=_HOVER))
    fig.update_yaxes(tickvals=list(range(len(lanes))), ticktext=lanes, autorange="reversed", showgrid=False)
    fig.update_xaxes(title_text="time (ms)", type="linear")
    fig.update_layout(title=title, height=max(320, 26 * len(lanes) + 140), hovermode="closest",
                      margin=dict(l=10, r=10, t=50, b=40), legend=dict(font=dict(size=10)))
    return fig


def sweep_figure(rows: list[dict]) -> list[tuple[str, go.Figure]]:
    """Tokens/s against pool size, a line per policy, `upper` dashed as the ceiling; one figure per
    (trace, profile, batch)."""
    keys = sorted({(r["trace"], r["profile"], r["batch"]) for r in rows})
    out = []
    for trace, profile, batch in keys:
        sel = [r for r in rows if (r["trace"], r["profile"], r["batch"]) == (trace, profile, batch) and not r["error"]]
        fig = go.Figure()
        for i, pol in enumerate(sorted({r["policy"] for r in sel}, key=lambda p: (p != "upper", p))):
            pts = sorted((r["pool_gb"], r["tokens_per_s"]) for r in sel if r["policy"] == pol)
            style = dict(color="black", dash="dash") if pol == "upper" else dict(color=POLICY_COLORS[i % len(POLICY_COLORS)])
            fig.add_trace(go.Scatter(x=[p for p, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                     name="upper (ceiling)" if pol == "upper" else pol, line=style))
        fig.update_layout(title=f"{trace}, {profile}, batch {batch}", xaxis_title="pool (GB)",
                          yaxis_title="tokens/s", height=420, margin=dict(l=10, r=10, t=50, b=40))
        out.append((f"{trace} / {profile} / batch {batch}", fig))
    return out
