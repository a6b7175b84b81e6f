"""The page `cmoe report BUNDLE` draws of a trace bundle: the `cmoe stats` table, each expert's
share of its layer's choices as a heatmap, and the per-layer statistics as lines (the random
baselines dashed), so a routing log is read at a glance before it is simulated."""

from __future__ import annotations

import html
from pathlib import Path


def stats_report(folder: Path) -> tuple[str, str]:
    from cmoe.report.page import Figures
    from cmoe.report.charts import layer_lines, load_heatmap
    from cmoe.trace import bundle
    from cmoe.trace.stats import format_table, layer_stats, load_share, one_hot, summary
    t = bundle.read(folder)
    s = t.spec
    layers = layer_stats(t)
    sm = summary(t, layers)
    share = load_share(one_hot(t.experts, s.num_experts)).tolist()
    ids = [x.layer for x in layers]
    lines = layer_lines(ids, {"entropy of the load / log E": [x.entropy for x in layers],
                              "consecutive tokens keep the first expert": [x.rep_first for x in layers],
                              "consecutive tokens share an expert": [x.rep_any for x in layers],
                              "commit prediction holds the true expert": [x.pred_acc for x in layers]},
                        "per layer (dashed: the same for uniform random routing)")
    for y, name in ((sm["random_rep_first"], "random: first expert kept"),
                    (sm["random_rep_any"], "random: an expert shared")):
        lines.add_hline(y=y, line=dict(color="#999999", dash="dash", width=1), annotation_text=name)
    figs = Figures()
    note = (f"{html.escape(str(folder))}: {sm['tokens']} tokens ({sm['decode_tokens']} decode) in {sm['requests']} "
            f"requests; top-{s.top_k} of {s.num_experts} experts over {s.num_moe_layers} MoE layers; "
            f"source: {html.escape(', '.join(f'{k} {v}' for k, v in t.source.items()) or 'not recorded')}.")
    blocks = [f"<p class='note'>{note}</p>", f"<pre>{html.escape(format_table(t, layers))}</pre>",
              "<h2>Expert load</h2>", figs.div(load_heatmap(share, ids)),
              "<h2>Repetition, balance and prediction by layer</h2>", figs.div(lines)]
    return f"trace statistics: {sm['model']}", "".join(blocks)
