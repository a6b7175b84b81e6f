"""The report's summary charts (plotly), each from figures `cmoe.analysis` computed: policies side
by side, where a decode pass's time goes, which experts the link carries, predicted against
measured per layer, and a trace's statistics. Every time axis is in milliseconds, as the timeline's.
"""

from __future__ import annotations

import plotly.graph_objects as go

from cmoe.analysis.breakdown import PARTS

PART_COLORS = dict(zip(PARTS, ("#F58518", "#4C78A8", "#E45756", "#9D755D", "#BAB0AC")))
BOUND_STYLE = {"upper": ("black", "dash"), "oracle": ("#54A24B", "dot")}
_MARGIN = dict(l=10, r=10, t=50, b=40)


def policy_bars(metrics: list[dict]) -> go.Figure:
    """Tokens/s per policy, fastest first, `upper` and `oracle` as vertical lines."""
    rows = sorted(metrics, key=lambda m: m["tokens_per_s"])
    bounds = {m["policy"]: m["tokens_per_s"] for m in metrics if m["policy"] in BOUND_STYLE}
    up = bounds.get("upper")
    text = [f"{m['tokens_per_s']:.1f}" + (f"  ({m['tokens_per_s'] / up:.2f}x upper)" if up else "") for m in rows]
    fig = go.Figure(go.Bar(x=[m["tokens_per_s"] for m in rows], y=[m["policy"] for m in rows], orientation="h",
                           text=text, textposition="auto", marker_color="#4C78A8", name="tokens/s",
                           hovertemplate="%{y}: %{x:.1f} tok/s<extra></extra>"))
    for name, x in bounds.items():
        color, dash = BOUND_STYLE[name]
        fig.add_vline(x=x, line=dict(color=color, dash=dash, width=1.5),
                      annotation_text=f"{name} {x:.1f}", annotation_position="top")
    fig.update_layout(title="tokens/s over decode passes", xaxis_title="tokens/s", showlegend=False,
                      height=120 + 34 * len(rows), margin=_MARGIN)
    return fig


def breakdown_figure(rows: list[tuple[str, dict[str, float]]]) -> go.Figure:
    """Stacked bars: a decode pass's milliseconds by part (`cmoe.analysis.breakdown.PARTS`)."""
    fig = go.Figure()
    names = [p for p, _ in rows]
    for part in PARTS:
        fig.add_trace(go.Bar(y=names, x=[d.get(part, 0.0) for _, d in rows], orientation="h", name=part,
                             marker_color=PART_COLORS[part], hovertemplate=f"%{{y}}: {part} %{{x:.3f}} ms<extra></extra>"))
    fig.update_layout(barmode="stack", title="where a decode pass's time goes (compute stream)",
                      xaxis_title="ms per decode pass", height=150 + 34 * len(rows), margin=_MARGIN,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def traffic_figure(runs: list[tuple[str, dict, int]], layers: list[int], experts: int) -> go.Figure:
    """A layer x expert heatmap per policy (a menu picks it): copies into the pool plus CPU runs per
    decode pass, the misses that cost the link or the CPU. `runs`: (policy, expert_traffic, passes)."""
    fig = go.Figure()
    for i, (policy, traffic, passes) in enumerate(runs):
        n = max(passes, 1)
        cell = [[traffic.get((m, e), {"runs": 0, "loads": 0, "cpu": 0}) for e in range(experts)] for m in layers]
        fig.add_trace(go.Heatmap(
            z=[[(c["loads"] + c["cpu"]) / n for c in row] for row in cell],
            customdata=[[[c["runs"], c["loads"], c["cpu"]] for c in row] for row in cell],
            x=list(range(experts)), y=[str(m) for m in layers], colorscale="Reds", zmin=0, visible=i == 0,
            name=policy, colorbar=dict(title="per pass"),
            hovertemplate=("layer %{y}, expert %{x}<br>copied in %{customdata[1]}x, on the CPU %{customdata[2]}x,"
                           " ran %{customdata[0]}x<br>%{z:.3f} misses per pass<extra>" + policy + "</extra>")))
    buttons = [dict(label=p, method="update", args=[{"visible": [j == i for j in range(len(runs))]},
                                                    {"title": f"misses by layer and expert: {p}"}])
               for i, (p, _, _) in enumerate(runs)]
    fig.update_layout(title=f"misses by layer and expert: {runs[0][0]}" if runs else "misses by layer and expert",
                      xaxis_title="expert", yaxis_title="decoder layer", height=220 + 14 * len(layers),
                      margin=dict(l=10, r=10, t=80, b=40),
                      updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.18, yanchor="top")] if len(runs) > 1 else [])
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def layer_scatter(runs: list[tuple[str, list[tuple[int, float, float]]]], band: float = 0.08) -> go.Figure:
    """Per policy, each layer's mean time per decode pass, predicted against measured (ms), with the
    line where they agree and the +-`band` lines around it."""
    fig = go.Figure()
    top = max((max(p, m) for _, pts in runs for _, p, m in pts), default=1.0) * 1.05
    for k, dash in ((1.0, "solid"), (1 + band, "dot"), (1 - band, "dot")):
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top * k], mode="lines", showlegend=k == 1.0,
                                 name=f"agree (dotted: +-{band:.0%})", line=dict(color="#999999", dash=dash, width=1),
                                 hoverinfo="skip"))
    for policy, pts in runs:
        fig.add_trace(go.Scatter(x=[m for _, _, m in pts], y=[p for _, p, _ in pts], mode="markers", name=policy,
                                 text=[str(layer) for layer, _, _ in pts],
                                 hovertemplate=("layer %{text}: measured %{x:.3f} ms, predicted %{y:.3f} ms"
                                                f"<extra>{policy}</extra>")))
    fig.update_layout(title="each layer's mean time per decode pass", xaxis_title="measured (ms)",
                      yaxis_title="predicted (ms)", height=520, margin=_MARGIN)
    return fig


def pass_ratio(runs: list[tuple[str, list[tuple[int, float, bool]]]]) -> go.Figure:
    """Per policy, each decode pass's measured time over its predicted one, in pass order; a pass
    whose host lane ran in its slow state (`cmoe.analysis.states.slow_host`) drawn as an open
    circle. A miss that follows the open circles is the machine's, not the model's."""
    fig = go.Figure()
    fig.add_hline(y=1.0, line=dict(color="#999999", width=1))
    for policy, pts in runs:
        fig.add_trace(go.Scatter(x=[p for p, _, _ in pts], y=[r for _, r, _ in pts], mode="lines+markers", name=policy,
                                 marker=dict(symbol=["circle-open" if s else "circle" for _, _, s in pts], size=7),
                                 line=dict(width=1),
                                 text=["slow host" if s else "" for _, _, s in pts],
                                 hovertemplate=f"pass %{{x}}: measured %{{y:.3f}}x predicted %{{text}}<extra>{policy}</extra>"))
    fig.update_layout(title="each decode pass, measured over predicted (open: the host lane in its slow state)",
                      xaxis_title="pass", yaxis_title="measured / predicted", height=420, margin=_MARGIN)
    return fig


def load_heatmap(share: list[list[float]], layers: list[int]) -> go.Figure:
    """A trace's expert load: each expert's share of its layer's routed choices."""
    E = len(share[0]) if share else 0
    fig = go.Figure(go.Heatmap(z=share, x=list(range(E)), y=[str(m) for m in layers], colorscale="Blues", zmin=0,
                               colorbar=dict(title="share"),
                               hovertemplate="layer %{y}, expert %{x}: %{z:.3f} of the layer's choices<extra></extra>"))
    fig.update_layout(title=f"expert load (uniform: {1 / E:.3f})" if E else "expert load", xaxis_title="expert",
                      yaxis_title="decoder layer", height=220 + 14 * len(layers), margin=_MARGIN)
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def layer_lines(layers: list[int], series: dict[str, list[float]], title: str) -> go.Figure:
    """One line per statistic over the decoder layers (a statistic that is NaN everywhere is left out)."""
    fig = go.Figure()
    for name, ys in series.items():
        if any(y == y for y in ys):
            fig.add_trace(go.Scatter(x=layers, y=ys, mode="lines+markers", name=name))
    fig.update_layout(title=title, xaxis_title="decoder layer", yaxis_range=[0, 1.02], height=380, margin=_MARGIN)
    return fig
