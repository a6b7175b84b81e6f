"""A diagnosis of a validation's CPU-expert rows (issue 15), from its measured runs: each decode
CPU expert's time by its tokens and by the CPU's idle before it, and the host around each CPU
layer's experts, read off the runs' timelines as calibrate reads its own `static` runs
(`log_points._cpu_points`, `_cpu_steps`, `cpu_in_model`, `cpu_fit.cpu_expert_fit`); then the
folder's profile with those fitted in, for `validate_table.py --profile` to predict with.

In sample by construction (fitted over the very runs it predicts): it says how much of a miss the
model's shape explains once its terms are right, not what a calibration would predict. Its profile
carries every `_cpu_steps` term, a CPU-expert policy's pass start and gap among them since the
thirtieth session (`cpu_pass_start_us`, `cpu_pass_gap_us`), so it predicts layer 0 from the runs too.

It also splits the one-token CPU experts' times into a run's effect and an expert's (`run_effects`):
whether a run's CPU experts are slow because of the run (a state of the host) or because of which
experts it put there (where their bytes sit). And it prints each run's host time per MoE layer in its decode passes (issue 13's figure):
`host_attention` + `host_route` + `host_expert`, and the same less the first round trip of each
CPU layer (its input's copy to the host, inside the route step: CPU work). Where the folder has
host-load.json (validate_h200's sampler, `cmoe.calibrate.host_load`) and its runs their clock's
epoch, the one-token experts by the host's other load and steal in their window (`load_effects`).

    python benchmarks/cpu_wake_diagnosis.py FOLDER OUT.json   # FOLDER: validate_h200's, untarred
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from cmoe.calibrate.cpu_fit import cpu_expert_fit  # noqa: E402
from cmoe.calibrate.log_points import _cpu_points, _cpu_steps, cpu_experts, cpu_in_model  # noqa: E402
from cmoe.core.checkpoint import check_checkpoint  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.core.timeline import END, EXPERT, LAYER, OP, START, STEP  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402
from cmoe.trace.passes import make_passes  # noqa: E402


def run_log(path: Path, passes) -> SimpleNamespace:
    """A measured timeline as the run log calibrate reads: its spans, and its passes as decode or
    not by the trace's own passes (`make_passes`)."""
    t = pl.read_parquet(path)
    spans = [tuple(r) for r in t.select("source", "step", "layer", "stream", "op", "expert", "start_us", "end_us",
                                        "bytes").iter_rows()]
    return SimpleNamespace(spans=spans, pass_us=[(p, bool(passes[p].decode), passes[p].num_tokens, 0.0)
                                                 for p in sorted(set(t["step"].to_list()))])


def host_lane(log, moe_layers: int) -> tuple[float, float]:
    """(host us per MoE layer, the same less each CPU layer's first round trip) over decode passes."""
    dec = {p for p, d, _, _ in log.pass_us if d}
    work = sum(s[7] - s[6] for s in log.spans if s[1] in dec and s[4] in ("host_attention", "host_route", "host_expert"))
    first: dict = {}
    for s in log.spans:
        if s[1] in dec and s[4] == "roundtrip" and ((s[1], s[2]) not in first or s[6] < first[s[1], s[2]][0]):
            first[s[1], s[2]] = (s[6], s[7] - s[6])
    n = max(len(dec), 1) * moe_layers
    return work / n, (work - sum(d for _, d in first.values())) / n


def layer0_after_host(log, first: int) -> float | None:
    """The median over decode passes of how long the GPU's layer-0 `attention` ran on past the end
    of the host's layer-0 `host_attention` (us): a CPU-expert policy's host launches the pass's
    start-up at the end of its own pass start (`HardwareProfile.startup_after_host`)."""
    dec = {p for p, d, _, _ in log.pass_us if d}
    ends: dict[int, dict[str, float]] = {}
    for s in log.spans:
        if s[STEP] in dec and s[LAYER] == first and s[OP] in ("attention", "host_attention"):
            e = ends.setdefault(s[STEP], {})
            e[s[OP]] = max(e.get(s[OP], s[END]), s[END])
    gaps = [e["attention"] - e["host_attention"] for e in ends.values() if len(e) == 2]
    return float(np.median(gaps)) if gaps else None


def one_token(ce: list) -> list[tuple[tuple[int, int], float]]:
    """((layer, expert), seconds) of every decode CPU expert that had one token (`ce`: the run's
    `cpu_experts`)."""
    return [((s[LAYER], s[EXPERT]), (s[END] - s[START]) / 1e6) for s, t in ce if t == 1]


def load_effects(timed: dict[str, list[tuple[float, float]]], rows: list[dict]) -> list[str]:
    """Lines: the one-token CPU experts (epoch start, ms) of every run by the host's other load and
    steal in the 0.1 s window they started in (`host_load.at`), median ms per bin of cores, beside
    the mean of our own cores there (`other` is all processes' less ours, a few ticks of noise a
    window either way, which grows with our own load: read a bin beside its `ours`); then each run's
    experts in six parts of equal count, median ms beside the load over the part's time
    (`host_load.mean_over`)."""
    from cmoe.calibrate.host_load import at, mean_over
    out, starts = [], [r["t0"] for r in rows]
    edges = (float("-inf"), 0.25, 0.75, 1.5, 3.0, float("inf"))
    for what in ("other", "steal"):
        by: dict[int, list] = {}
        for xs in timed.values():
            for t, ms in xs:
                if (r := at(rows, t, starts)) is not None:
                    by.setdefault(next(i for i in range(len(edges) - 1) if r[what] < edges[i + 1]), []).append((ms, r["ours"]))
        out.append(f"one-token CPU experts by the host's {what} cores in their window: " + ", ".join(
            f"{max(edges[k], 0):g}-{edges[k + 1]:g}: {np.median([m for m, _ in v]):.2f} ms over {len(v)} "
            f"(ours {np.mean([o for _, o in v]):.1f})" for k, v in sorted(by.items())))
    for run, xs in timed.items():
        if len(xs) < 6:
            continue
        parts = []
        for part in np.array_split(np.array(xs), 6):
            m = mean_over(rows, part[0, 0], part[-1, 0] + part[-1, 1] / 1e3)
            parts.append(f"{np.median(part[:, 1]):.2f}" + (f" ({m['other']:.2f}/{m['steal']:.2f})" if m else ""))
        out.append(f"{run}: six parts of equal count, median ms (other/steal cores) " + " ".join(parts))
    return out


def run_effects(seen: dict[str, list]) -> dict:
    """log(median seconds of expert k in run r) = run effect + expert effect, least squares over
    every (run, expert) pair measured: each run's factor (geometric mean 1), the experts' factors'
    spread (sd of the log) and what neither explains (the residual's sd of the log)."""
    runs = [r for r, v in seen.items() if v]
    by = {(r, k): [] for r in runs for k, _ in seen[r]}
    for r in runs:
        for k, x in seen[r]:
            by[r, k].append(x)
    keys = sorted({k for _, k in by})
    ri, ki = {r: i for i, r in enumerate(runs)}, {k: i for i, k in enumerate(keys)}
    a = np.zeros((len(by), len(runs) + len(keys)))
    y = np.log([float(np.median(v)) for v in by.values()])
    for i, (r, k) in enumerate(by):
        a[i, ri[r]] = a[i, len(runs) + ki[k]] = 1.0
    sol = np.linalg.lstsq(a, y, rcond=None)[0]
    run, exp = sol[:len(runs)] - sol[:len(runs)].mean(), sol[len(runs):] - sol[len(runs):].mean()
    return {"runs": {r: float(np.exp(e)) for r, e in zip(runs, run)}, "expert_log_sd": float(exp.std()),
            "residual_log_sd": float((y - a @ sol).std()), "pairs": len(by), "experts": len(keys)}


def runs_omp(rows: list[dict], res: dict) -> str:
    """The OpenMP settings the measured runs recorded (`omp_wait_policy` in their metrics.json rows:
    wait policy and binding, as `cmoe.executor.omp_wait.in_force` gives them; one process records
    one value for all its runs); for folders from before runs recorded it, what libgomp made of the
    variables results.json kept (`omp_env`); "" where neither says."""
    from cmoe.executor.omp_wait import describe
    said = next((m["omp_wait_policy"] for m in rows if m.get("omp_wait_policy")), "")
    return said or (describe(res["omp_env"]) if res.get("omp_env") is not None else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    res = json.loads((a.folder / "results.json").read_text())
    spec = check_checkpoint(Path(res["model"]), float_experts=True) if res.get("model") else preset(res["spec"])
    pts, trips, steps, seen, timed, metrics_rows = [], [], {}, {}, {}, []
    for c in res["configs"]:
        b = c["batch"]
        tr = load_trace(res.get("trace") or f"synthetic:{res['spec']}", None, b)
        passes = make_passes(tr, b)
        for x in ("measured", "measured-2"):               # validate-r's second runs too
            here = a.folder / f"pool{c['pool_gb']:g}-b{b}" / x
            if not here.is_dir():
                continue
            rows = json.loads((here / "metrics.json").read_text())
            metrics_rows += rows
            zero = {m["policy"]: m.get("clock_epoch") for m in rows}
            for f in sorted(here.glob("timeline-*.parquet")):
                run = f"pool {c['pool_gb']:g} batch {b} {f.stem[9:]}" + (" again" if x == "measured-2" else "")
                log = run_log(f, passes)
                w, own = host_lane(log, spec.num_moe_layers)
                after = layer0_after_host(log, spec.moe_layers[0])
                print(f"{run}: host {w:.1f} us a MoE layer, {own:.1f} less the copy to the host"
                      + (f"; layer 0's attention ends {after:.1f} us after the host's (median)" if after is not None else ""))
                p, t = _cpu_points(log, tr, b, spec)
                ce = list(cpu_experts(log, tr, b, spec))
                seen[run] = one_token(ce)
                if zero.get(f.stem[9:]):
                    timed[run] = [(zero[f.stem[9:]] + s[START] / 1e6, (s[END] - s[START]) / 1e3) for s, k in ce if k == 1]
                pts, trips = pts + p, trips + [(b, y) for y in t]
                for k, v in _cpu_steps(log).items():                # pass_points: each pair of passes'
                    steps.setdefault(k, []).extend(v)                 # CPU layers before, rows, start, gap
    if sum(1 for v in seen.values() if v) > 1:
        fx = run_effects(seen)
        print(f"one-token CPU experts over {fx['pairs']} (run, expert) pairs of {fx['experts']} experts: each run's factor "
              + ", ".join(f"{r} {x:.2f}" for r, x in fx["runs"].items())
              + f"; experts' own spread {fx['expert_log_sd']:.3f}, unexplained {fx['residual_log_sd']:.3f} (sd of the log)")
    if (a.folder / "host-load.json").exists() and any(timed.values()):
        for line in load_effects(timed, json.loads((a.folder / "host-load.json").read_text())["windows"]):
            print(line)
    starts = [(n, rows, s * 1e6) for n, rows, s, _ in steps.get("pass_points", [])]
    if len({n for n, _, _ in starts}) > 1:
        x, r, y = np.array(starts, float).T
        (a0, a1), *_ = np.linalg.lstsq(np.c_[np.ones_like(x), x], y, rcond=None)
        print(f"CPU-expert pass start: {a0:.0f} us + {a1:.2f} a layer with CPU experts in the pass before "
              f"({x.min():.0f}-{x.max():.0f} layers), residual sd {np.std(y - a0 - a1 * x):.0f} us over {len(y)} pairs; "
              f"mean {y.mean():.0f} us")
        if len(set(r)) > 1:                                # the rows too, where the folder has two batches
            X = np.c_[np.ones_like(x), x, r - 1]
            b, *_ = np.linalg.lstsq(X, y, rcond=None)
            print(f"  with the rows: {b[0]:.0f} us + {b[1]:.2f} a layer + {b[2]:.2f} a row past the first, "
                  f"residual sd {np.std(y - X @ b):.0f} us")
    if not pts:
        sys.exit("no CPU experts in this folder's decode passes: give a validation that ran lfu-fallback or static")
    meas = json.loads((a.folder / "profile.measurements.json").read_text())
    m = {"cpu_expert": meas["cpu_expert"]} | cpu_in_model(pts, trips, steps)
    for t, lo, idle, s, n in m["cpu_expert_in_model"]["idle"]:
        print(f"{t} tokens, idle from {lo / 1e3:g} ms (mean {idle / 1e3:.2f}): {s * 1e3:.2f} ms over {n}")
    ca, cb, fields = cpu_expert_fit(m)
    wake = fields.get("cpu_wake_points", ())
    prof = json.loads((a.folder / "profile.json").read_text())
    prof |= {"name": prof["name"] + "-cpu-diagnosis", "cpu_expert_gbps": meas["cpu_expert"]["bytes"] / ca / 1e9,
             "cpu_expert_us_per_token": max(cb, 0.0) * 1e6, "cpu_wake_points": [list(w) for w in wake],
             "cpu_expert_points": [list(x) for x in fields.get("cpu_expert_points", ())],
             **{f"cpu_{k}_us": v * 1e6 for k, v in m["cpu_step"].items()},
             "roundtrip_points": [[b, s * 1e6] for b, s in m["roundtrip_points"]] if len(m["roundtrip_points"]) > 1 else [],
             "omp_wait_policy": runs_omp(metrics_rows, res)}     # the runs' own, as they recorded it
    print(f"base {ca * 1e6:.0f} us + {cb * 1e6:.0f} a token (by tokens: "
          + ", ".join(f"{t} {x:.2f}x" for t, x in fields.get("cpu_expert_points", ())) + f"); wake {[(round(x), round(y)) for x, y in wake]}; "
          + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in m["cpu_step"].items()))
    write_text_atomic(a.out, json.dumps(prof, indent=1))


if __name__ == "__main__":
    main()
