"""Does a validation's layer-0 miss follow the host lane's state? (issue 15, fiftieth session)

For every row of a `benchmarks/validate_table.py` summary whose worst layer missed by more than
8% in a run, that run's decode passes are split where its host lane ran in two states
(`cmoe.analysis.states.slow_host`, the split `cmoe validate` names: groups at least 1.3x apart
that take 80% of the log speeds' variance), and that layer's mean-time error is read over each
state's passes (a state of fewer than `--least` passes says nothing). A run in one state is
listed with its one figure. The prediction is one figure for both states, so the gap between them
is the measured layer's own.

    python benchmarks/layer0_states.py WORK SUMMARY [WORK SUMMARY ...] [--least 3]

WORK is the `--work` folder validate_table.py predicted into (its poolP-bB/predicted, and
unpacked/poolP-bB/measured where the input came as tarballs) and SUMMARY the JSON it wrote
(`--out`); where the input was a folder of runs already, give it as WORK after copying the
predictions in, or point WORK at a folder holding both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.analysis.states import pass_host_us, slow_host  # noqa: E402
from cmoe.analysis.validate import LAYER_TOL, layer_times, read_run  # noqa: E402


def by_state(pred, meas, layer: int, least: int) -> tuple[float | None, float | None]:
    """(the error of `layer`'s mean time over the measured run's fast passes, over its slow ones:
    all its passes fast where it ran in one state), each None where that state has fewer than
    `least` passes."""
    dp, dm = ({p["pass"]: p for p in r.passes if p["decode"]} for r in (pred, meas))
    steps = set(dp) & set(dm)
    lp, lm = layer_times(pred.spans, steps), layer_times(meas.spans, steps)
    host = pass_host_us(meas.spans, steps)
    slow = set((slow_host(meas.spans, steps, dp, dm) or {}).get("slow_passes") or [])

    def err(passes):
        keys = [(p, layer) for p in sorted(passes) if (p, layer) in lp and (p, layer) in lm]
        if len(keys) < least:
            return None
        a, b = np.mean([lp[k] for k in keys]), np.mean([lm[k] for k in keys])
        return float((a - b) / b)
    return err(set(host) - slow), err(slow)


def rows_of(work: Path, summary: Path, least: int) -> list[dict]:
    """Every row of `summary` with a layer past `LAYER_TOL` in one of its runs: that run's worst
    layer's error over each host state."""
    out = []
    for r in json.loads(summary.read_text())["rows"]:
        i = next((k for k, e in enumerate(r["layer_mean_error_worst"]) if abs(e) > LAYER_TOL), None)
        if i is None:
            continue
        here, name = f"pool{r['pool_gb']:g}-b{r['batch']}", ("measured", "measured-2")[i]
        measured = work / "unpacked" / here / name
        if not measured.is_dir():
            sys.exit(f"layer0_states.py: {measured} is missing: give the --work folder validate_table.py unpacked into")
        pred, meas = read_run(work / here / "predicted", r["policy"]), read_run(measured, r["policy"])
        fast, slow = by_state(pred, meas, r["layer_worst"][i], least)
        out.append({"config": here, "policy": r["policy"], "layer": r["layer_worst"][i],
                    "error": r["layer_mean_error_worst"][i], "fast": fast, "slow": slow})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs", nargs="+", type=Path, help="WORK SUMMARY, once per validation")
    ap.add_argument("--least", type=int, default=3, help="fewest passes a state's figure is read over")
    a = ap.parse_args()
    if len(a.pairs) % 2:
        sys.exit("layer0_states.py: give WORK SUMMARY pairs (validate_table.py's --work folder and --out file)")
    rows = [x | {"validation": str(s)} for w, s in zip(a.pairs[::2], a.pairs[1::2])
            for x in rows_of(w, s, a.least)]
    f = lambda e: "-" if e is None else f"{e * 100:+.1f}%"  # noqa: E731
    print("| validation | configuration | policy | layer | error | fast passes | slow passes |\n| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for x in rows:
        print(f"| {x['validation']} | {x['config']} | {x['policy']} | {x['layer']} | {f(x['error'])} | {f(x['fast'])} | {f(x['slow'])} |")
    both = [abs(x["fast"] - x["slow"]) for x in rows if x["fast"] is not None and x["slow"] is not None]
    one = sum(any(e is not None and abs(e) <= LAYER_TOL for e in (x["fast"], x["slow"])) for x in rows)
    print(f"{len(rows)} rows with a layer past {LAYER_TOL:.0%}; {one} within it over one state's passes; "
          f"{len(both)} in two states of {a.least}+ passes each, their gap "
          + (f"{np.median(both) * 100:.1f} points at the median, {max(both) * 100:.1f} at most" if both else "-"))


if __name__ == "__main__":
    main()
