"""The frontier: tokens/s against the KL divergence to exact routing, one point per policy of a run,
with `oracle` and `upper` as dashed horizontal lines (`cmoe report RUN --quality QUALITY.json`).

Tokens/s come from the run's metrics. KL comes from what `cmoe quality --out` writes: a policy that
never leaves a routed expert out (trait `skips` false) gives exact routing's outputs, so it sits at
KL 0 and top-1 agreement 1 by construction; a skipping policy (commit, adaptive) takes the row of
the quality variant of its own name, the one with OWA on (`cmoe.quality.run.VARIANTS`; the tests
hold this module to it, so the report needs no torch). A skipping policy without a row is not
measured: it is listed, never drawn at 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go

from cmoe.core.errors import CmoeError
from cmoe.policy.policies import POLICIES, trait
from cmoe.report.figures import POLICY_COLORS

QUALITY_FIX = "pass --quality the JSON file that cmoe quality --out FILE writes"
# the pool each skipping policy's quality variant is measured with (cmoe.quality.run.VARIANTS)
HALF = "half of each layer's experts in the pool"
MEASURED_WITH = {"commit": "every expert resident", "adaptive": HALF, "adaptive-ahead": HALF, "commit-ahead": HALF}
LINES = ("oracle", "upper")


def _number(x, low: float = -math.inf, high: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def read_quality(path: Path) -> dict:
    """The JSON `cmoe quality --out` writes, checked to hold a `rows` list of variants, each with a
    finite `kl_mean` and a `top1_agreement` in [0, 1], one row per variant."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CmoeError(f"{path} is not readable JSON ({type(e).__name__}): {QUALITY_FIX}") from None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise CmoeError(f"{path} has no 'rows' list of variants, so it is not what cmoe quality writes: {QUALITY_FIX}")
    seen = set()
    for r in rows:
        if not (isinstance(r, dict) and isinstance(r.get("variant"), str) and _number(r.get("kl_mean"))
                and _number(r.get("top1_agreement"), 0.0, 1.0)):
            raise CmoeError(f"{path}: a row lacks a variant, a finite kl_mean or a top1_agreement in [0, 1]: {QUALITY_FIX}")
        if r["variant"] in seen:
            raise CmoeError(f"{path} has two rows for variant {r['variant']}: {QUALITY_FIX}")
        seen.add(r["variant"])
    return doc


@dataclass
class Frontier:
    """`points`: every policy of the run, fastest first, as dicts of policy, tokens_per_s,
    x_oracle (None without oracle), kl and top1 (None where not measured); `lines`: the dashed
    lines' tokens/s by name (those the run has); `unmeasured`: the skipping policies left out."""
    points: list[dict] = field(default_factory=list)
    lines: dict[str, float] = field(default_factory=dict)
    unmeasured: list[str] = field(default_factory=list)

    @property
    def drawn(self) -> list[dict]:
        return [p for p in self.points if p["kl"] is not None]


def frontier_data(metrics: list[dict], quality: dict) -> Frontier:
    """The frontier's points from a run's metrics and a checked quality document (no plotly)."""
    rows = {r["variant"]: r for r in quality["rows"]}
    tps = {m["policy"]: m["tokens_per_s"] for m in metrics}
    oracle = tps.get("oracle")
    out = Frontier(lines={name: tps[name] for name in LINES if name in tps})
    for m in sorted(metrics, key=lambda m: -m["tokens_per_s"]):
        pol, y = m["policy"], m["tokens_per_s"]
        if pol in POLICIES and not trait(pol, "skips"):
            kl, top1 = 0.0, 1.0                   # exact routing: the same outputs by construction
        elif pol in POLICIES and pol in rows:
            kl, top1 = rows[pol]["kl_mean"], rows[pol]["top1_agreement"]
        else:                                     # skips, or a policy this version does not know
            kl = top1 = None
            out.unmeasured.append(pol)
        out.points.append({"policy": pol, "tokens_per_s": y, "x_oracle": y / oracle if oracle else None,
                           "kl": kl, "top1": top1})
    return out


def _label_sides(drawn: list[dict]) -> list[str]:
    """Labels of points at one KL alternate right and left (fastest first), so near ties stay apart."""
    count: dict[float, int] = {}
    sides = []
    for p in drawn:
        n = count.get(p["kl"], 0)
        count[p["kl"]] = n + 1
        sides.append("middle right" if n % 2 == 0 else "middle left")
    return sides


def frontier_figure(f: Frontier) -> go.Figure:
    fig = go.Figure()
    drawn = f.drawn
    for i, (p, side) in enumerate(zip(drawn, _label_sides(drawn))):
        fig.add_trace(go.Scatter(
            x=[p["kl"]], y=[p["tokens_per_s"]], mode="markers+text", text=[p["policy"]], textposition=side,
            name=p["policy"], marker=dict(size=11, color=POLICY_COLORS[i % len(POLICY_COLORS)]),
            hovertemplate=f"{p['policy']}<br>%{{y:.1f}} tok/s<br>KL %{{x:.4f}} nats<br>"
                          f"top-1 agreement {p['top1']:.3f}<extra></extra>"))
    for name, y in f.lines.items():
        fig.add_hline(y=y, line=dict(dash="dash", color="black" if name == "upper" else "#777", width=1.5),
                      annotation_text=f"{name} {y:.1f} tok/s", annotation_position="top right")
    span = max((p["kl"] for p in drawn), default=0.0) or 1.0
    fig.update_xaxes(title_text="KL divergence to exact routing (nats per position, mean)",
                     range=[-0.4 * span, 1.35 * span], zeroline=True)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero")
    fig.update_layout(title="tokens/s against quality", height=460, showlegend=False,
                      margin=dict(l=10, r=10, t=50, b=40))
    return fig
