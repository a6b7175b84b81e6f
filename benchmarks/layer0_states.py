"""Does a validation's layer-0 miss follow the host lane's state? (issue 15, fiftieth session)

For every row of a `benchmarks/validate_table.py` summary whose worst layer missed by more than
8%, its first measured run's decode passes are split by host speed (`cmoe.analysis.states.pass_host_us`:
slow where the median `host_attention` past the first layer took `--slow-us` or more; the lent
H100s' hosts ran ~2.2-2.7 us or ~5), and that layer's mean-time error is read over each half
(halves of fewer than `--least` passes say nothing). The prediction is one figure for both, so
the gap between the halves is the measured layer's own.

    python benchmarks/layer0_states.py WORK SUMMARY [WORK SUMMARY ...] [--slow-us 3.5] [--least 5]

WORK is the `--work` folder validate_table.py predicted into (its poolP-bB/predicted and
unpacked/poolP-bB/measured, or poolP-bB/measured where the input was unpacked already) and
SUMMARY the JSON it wrote (`--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.analysis.states import pass_host_us  # noqa: E402
from cmoe.analysis.validate import LAYER_TOL, _layer_times, read_run  # noqa: E402


def by_state(pred, meas, layer: int, slow_us: float, least: int) -> tuple[float | None, float | None]:
    """(the error of `layer`'s mean time over the measured run's fast passes, over its slow ones),
    each None where that half has fewer than `least` passes."""
    steps = {p["pass"] for p in pred.passes if p["decode"]} & {p["pass"] for p in meas.passes if p["decode"]}
    lp, lm = _layer_times(pred.spans, steps), _layer_times(meas.spans, steps)
    host = pass_host_us(meas.spans, steps)
    slow = {p for p, v in host.items() if v >= slow_us}

    def err(passes):
        keys = [(p, layer) for p in sorted(passes) if (p, layer) in lp and (p, layer) in lm]
        if len(keys) < least:
            return None
        a, b = np.mean([lp[k] for k in keys]), np.mean([lm[k] for k in keys])
        return float((a - b) / b)
    return err(set(host) - slow), err(slow)


def rows_of(work: Path, summary: Path, slow_us: float, least: int) -> list[dict]:
    """Every row of `summary` with a layer past `LAYER_TOL`, its worst layer's error by state."""
    out = []
    for r in json.loads(summary.read_text())["rows"]:
        worst = [w for w, e in zip(r["layer_worst"], r["layer_mean_error_worst"]) if abs(e) > LAYER_TOL]
        if not worst:
            continue
        here = f"pool{r['pool_gb']:g}-b{r['batch']}"
        measured = next(f for f in (work / "unpacked" / here / "measured", work / here / "measured") if f.is_dir())
        pred, meas = read_run(work / here / "predicted", r["policy"]), read_run(measured, r["policy"])
        fast, slow = by_state(pred, meas, worst[0], slow_us, least)
        out.append({"config": here, "policy": r["policy"], "layer": worst[0], "error": r["layer_mean_error_worst"][0],
                    "fast": fast, "slow": slow})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", type=Path, help="WORK SUMMARY, once per validation")
    ap.add_argument("--slow-us", type=float, default=3.5)
    ap.add_argument("--least", type=int, default=5)
    a = ap.parse_args()
    if len(a.pairs) % 2:
        sys.exit("layer0_states.py: give WORK SUMMARY pairs (validate_table.py's --work folder and --out file)")
    rows = [x | {"validation": str(s)} for w, s in zip(a.pairs[::2], a.pairs[1::2])
            for x in rows_of(w, s, a.slow_us, a.least)]
    f = lambda e: "-" if e is None else f"{e * 100:+.1f}%"  # noqa: E731
    print("| validation | configuration | policy | layer | error | fast passes | slow passes |\n| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for x in rows:
        print(f"| {x['validation']} | {x['config']} | {x['policy']} | {x['layer']} | {f(x['error'])} | {f(x['fast'])} | {f(x['slow'])} |")
    both = [abs(x["fast"] - x["slow"]) for x in rows if x["fast"] is not None and x["slow"] is not None]
    one = sum(any(e is not None and abs(e) <= LAYER_TOL for e in (x["fast"], x["slow"])) for x in rows)
    print(f"{len(rows)} rows with a layer past {LAYER_TOL:.0%}; {one} within it over one state's passes; "
          f"{len(both)} with both states' {a.least}+ passes, their gap "
          + (f"{np.median(both) * 100:.1f} points at the median, {max(both) * 100:.1f} at most" if both else "-"))


if __name__ == "__main__":
    main()
