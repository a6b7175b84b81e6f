"""The one-row-per-policy table that `cmoe simulate` and `cmoe execute` print, from metrics dicts
(predicted or measured: the same keys, `cmoe.core.metrics`). Measured runs add the achieved H2D
bandwidth. The first line says the scope: every column covers the decode passes only."""

from __future__ import annotations


def scope_line(metrics: list[dict]) -> str:
    m = metrics[0]
    return (f"every column over {m.get('decode_passes', '?')} decode passes ({m['decode_tokens']} tokens); "
            f"prefill apart: {max(x['prefill_ms'] for x in metrics):.1f} ms at most, "
            f"{max(x.get('prefill_loads', 0) for x in metrics)} loads at most")


def policy_table(metrics: list[dict]) -> str:
    up = next((m["tokens_per_s"] for m in metrics if m["policy"] == "upper"), None)
    h2d = any("h2d_gbps" in m for m in metrics)
    rows = [scope_line(metrics) if metrics else "no runs",
            f"{'policy':<14} {'tok/s':>8} {'x upper':>7} {'TPOT ms':>8} {'p99 ms':>8} {'hit':>6} {'late':>6} {'loads':>7} "
            f"{'GB moved':>9}" + (f" {'H2D GB/s':>8}" if h2d else "") +
            f" {'fallback':>8} {'skipped':>7} {'stall ms':>9} {'fit':>5}"]
    for m in metrics:
        ratio = f"{m['tokens_per_s'] / up:7.2f}" if up else f"{'-':>7}"
        rows.append(f"{m['policy']:<14} {m['tokens_per_s']:8.1f} {ratio} {m['tpot_ms_mean']:8.2f} {m['tpot_ms_p99']:8.2f} "
                    f"{m['hit_rate']:6.3f} {m.get('late', 0):6d} {m['loads']:7d} {m['bytes_moved'] / 1e9:9.2f}"
                    + (f" {m['h2d_gbps']:8.1f}" if h2d else "") +
                    f" {m['fallbacks']:8d} {m['skipped']:7d} {m['stall_ms']:9.1f} {m['experts_fit']:5d}")
    return "\n".join(rows)
