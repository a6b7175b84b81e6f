"""Predicted against measured, from the folder `benchmarks/validate_h200.py` wrote on the GPU: the
simulator (deterministic, so it can run anywhere) replays each configuration with the profile
calibrated in that same GPU run, and `cmoe validate` holds it against each measured run.

Prints a Markdown table and writes `summary.json` beside the input:

    python benchmarks/validate_table.py OUT/v [--out benchmarks/results/validate-h200.json] [--profile P.json]
        [--host-adjust] [--link-adjust] [--against OTHER_SESSION/profile.json]

OUT/v is the folder validate_h200.py wrote, or the one `gpu_session.sh validate` brought back
(head.tgz and meas-bB.tgz, unpacked under --work, where summary.json then goes too).

Errors are relative to the measurement; with two measured runs (`--repeat`), the error is taken
against their mean and the runs' own spread is shown beside it: where the spread is as large as
the error, the host's noise, not the model, decides the figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from itertools import zip_longest
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.checkpoint import check_checkpoint  # noqa: E402
from cmoe.core.hw import load_profile  # noqa: E402
from cmoe.pipeline import host_ratio, host_speed, host_timed, predict  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402
from cmoe.analysis.validate import against_repeats, calibrations_agree, cpu_ratio, link_ratio, read_run, validate  # noqa: E402
from cmoe.analysis.boundary import boundaries, boundary_price  # noqa: E402
from cmoe.analysis.states import states_note  # noqa: E402
from cmoe.core.cpu_ref import cpu_ref_note, validation_ratio  # noqa: E402
from cmoe.analysis.runfolder import read_metrics  # noqa: E402
from cmoe.sim.priced import priceable  # noqa: E402
from cmoe.policy.policies import python_step, trait  # noqa: E402


def unpacked(folder: Path, work: Path, tool: str = "validate_table.py") -> Path:
    """The folder itself where it holds results.json; else, where it holds what `gpu_session.sh
    validate` brings back (head.tgz and a meas-bB.tgz a batch), those unpacked under WORK/unpacked,
    the folder left as it came (the device tool's copies are read-only). One line (`tool`: the
    script that reads it) and exit status 1 where it holds neither."""
    if (folder / "results.json").is_file():
        return folder
    if not (folder / "head.tgz").is_file():
        sys.exit(f"{tool}: {folder} holds neither results.json nor head.tgz: give the folder "
                 "benchmarks/validate_h200.py wrote, or the one gpu_session.sh validate brought back")
    out = work / "unpacked"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for t in [folder / "head.tgz", *sorted(folder.glob("meas-b*.tgz"))]:
        with tarfile.open(t) as tar:
            tar.extractall(out, filter="data")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cmoe-validate-table"),
                    help="scratch folder: its poolP-bB/predicted* folders (the predictions) and unpacked/ (the "
                    "tarballs a device call brought back) are replaced")
    ap.add_argument("--profile", type=Path, default=None,
                    help="predict with this profile instead of the folder's (a diagnosis: say so beside its table)")
    ap.add_argument("--host-adjust", action="store_true",
                    help="also predict each configuration with the profile's host costs scaled by its runs' measured "
                    "host speed (`cmoe.pipeline.host_speed`, the mean over the configuration's runs): a diagnosis of "
                    "how much of an error the host's drift explains")
    ap.add_argument("--link-adjust", action="store_true",
                    help="also predict each policy's run with the profile's link scaled to the rate its loads moved at "
                    "(`cmoe.analysis.validate.link_ratio`, the mean over its runs): how much of an error the link's drift explains")
    ap.add_argument("--cpu-adjust", action="store_true",
                    help="also predict each CPU-expert policy's run with its CPU experts as slow as they ran "
                    "(`cmoe.analysis.validate.cpu_ratio`, the mean over its runs): how much of an error they explain")
    ap.add_argument("--cpu-ref-adjust", action="store_true",
                    help="also predict each policy's run with the profile's host costs scaled by the CPU's plain loop "
                    "around it over the loop at calibration (`cmoe.core.cpu_ref`, the mean over its runs): how much of "
                    "an error the CPU's own speed explains, measured apart from the host lane")
    ap.add_argument("--against", type=Path, default=None,
                    help="also predict each configuration with this profile (another session's calibration) and "
                    "count the rows the two predict within 2%% of each other (issue 15's second condition)")
    a = ap.parse_args()
    came, a.folder = a.folder, unpacked(a.folder, a.work)
    if a.out is None:             # not into the device tool's copy of the tarballs: it is read-only
        a.out = (came if a.folder == came else a.work) / "summary.json"
        if a.folder != came:
            print(f"{came} holds tarballs: summary.json goes to {a.out}", file=sys.stderr)
    res = json.loads((a.folder / "results.json").read_text())
    prof = load_profile(str(a.profile or a.folder / "profile.json"))
    other = load_profile(str(a.against)) if a.against else None
    spec = check_checkpoint(Path(res["model"]), float_experts=True) if res.get("model") else preset(res["spec"])
    trace_src, fmt = res.get("trace") or f"synthetic:{res['spec']}", res.get("expert_format", "w4g128")
    priced: set[str] = set()                # the policies the other calibration can price (`cmoe.sim.priced`)
    if other is not None:
        got, note = priceable(other, list(dict.fromkeys(p for c in res["configs"] for p in c["policies"])), every=True)
        priced = set(got)
        if note:
            print(f"--against: {note}", file=sys.stderr)
    rows = []
    for c in res["configs"]:
        pool, b = c["pool_gb"], c["batch"]
        here = a.folder / f"pool{pool:g}-b{b}"
        if not (here / "measured").is_dir():        # no rows, rather than a summary without them
            sys.exit(f"validate_table.py: {here} has no measured runs: give the folder with meas-b{b}.tgz "
                     f"(or its pool*-b{b} folders) beside head.tgz")
        pols = list(c["policies"])
        w = SimpleNamespace(trace=load_trace(trace_src, None, b), spec=spec, fmt=fmt)
        # the policies whose runs planned in the Python step (the program off, or none yet for them)
        ran = {m["policy"]: m.get("host_program") for x in ("measured", "measured-2") if (here / x).is_dir()
               for m in read_metrics(here / x)}
        stepped = {p for p in pols if python_step(p, ran.get(p) is not False)}

        def run_sim(policies, profile, folder, pool=pool, b=b, w=w, stepped=stepped):     # this configuration
            predict(w, SimpleNamespace(policies=policies, pool_gb=pool, batch=b, slots=res.get("slots"), tokens=res["tokens"],
                                       include_prefill=True, python_step=stepped), profile, folder)

        def held(profile, folder, policies):
            """policy -> its prediction under `profile` held against every measured run of it."""
            run_sim(policies, profile, folder)
            got = [[validate(read_run(folder, p), ms[pols.index(p)]) for p in policies] for ms in measured]
            return {r["policy"]: r for r in against_repeats(got)}
        pred = a.work / here.name / "predicted"
        for old in ("predicted", "predicted-host", "predicted-link", "predicted-cpu", "predicted-cpu-ref",
                    "predicted-other"):  # scratch
            shutil.rmtree(pred.with_name(old), ignore_errors=True)
        run_sim(pols, prof, pred)
        # each measured run read once, held against the prediction (and under --host-adjust the second)
        measured = [[read_run(here / x, p) for p in pols] for x in ("measured", "measured-2") if (here / x).is_dir()]
        runs = [[validate(read_run(pred, p), m) for p, m in zip(pols, ms)] for ms in measured]
        ratios = host_speed(runs, prof, b)
        speed = sum(ratios) / len(ratios) if ratios else None
        adjusted = {}
        if a.host_adjust and speed:
            adjusted = held(prof.host_scaled(speed), a.work / here.name / "predicted-host", pols)
        def at_runs_speed(on: bool, ratio, scaled, name: str) -> dict:
            """Each policy predicted with one part of the machine as fast as its runs found it (the
            mean of `ratio` over its runs; `scaled` the profile so changed)."""
            got = {}
            for i, p in enumerate(pols if on else []):
                if ks := [k for r in runs if (k := ratio(r[i])) is not None]:
                    got |= held(scaled(sum(ks) / len(ks)), a.work / here.name / f"predicted-{name}" / p, [p])
            return got
        linked = at_runs_speed(a.link_adjust, link_ratio, prof.link_scaled, "link")
        cpus = at_runs_speed(a.cpu_adjust, cpu_ratio, prof.cpu_scaled, "cpu")
        refs = at_runs_speed(a.cpu_ref_adjust, validation_ratio, prof.host_scaled, "cpu-ref")
        kept = [p for p in pols if p in priced]
        others = held(other, a.work / here.name / "predicted-other", kept) if kept else {}
        for i, agg in enumerate(against_repeats(runs)):
            vs = [r[i] for r in runs]
            tpot_m = [v["per_token"]["meas_mean_us"] / 1e3 for v in vs]
            rows.append({"pool_gb": pool, "batch": b, "experts_fit": c["experts_fit"], "policy": agg["policy"],
                         "predicted_tok_s": agg["predicted"], "measured_tok_s": agg["measured"],
                         "error": agg["error"], "spread": agg["spread"],
                         "predicted_tpot_ms": vs[0]["per_token"]["pred_mean_us"] / 1e3,
                         "measured_tpot_ms": sum(tpot_m) / len(tpot_m),
                         "layer_mean_error_worst": agg["per_layer_mean_error_max"],
                         "layer_mean_error_worst_past_first": agg["per_layer_mean_error_max_rest"],
                         "layer_worst": [v.get("per_layer_worst") for v in vs],
                         "layer_mape_mean": [v["per_layer_mape_mean"] for v in vs],
                         "error_from": [v["error_from"] for v in vs],
                         "host_speed": [host_ratio(v, prof, b) for v in vs],
                         "link_speed": [link_ratio(v) for v in vs], "slow_loads": [v.get("slow_loads") for v in vs],
                         "cpu_speed": [cpu_ratio(v) for v in vs], "slow_cpu": [v.get("slow_cpu") for v in vs],
                         "slow_host": [v.get("slow_host") for v in vs], "cpu_ref": [validation_ratio(v) for v in vs],
                         "boundary_speed": [x[0] / x[1] if (x := boundary_price(boundaries(ms[i]), prof,
                                                                                  trait(agg["policy"], "cpu_experts")))
                                            else None for ms in measured]}
                        | ({"layer_repeats": agg["per_layer_repeats"]} if len(vs) > 1 else {})
                        | ({"host_adjusted_tok_s": adjusted[agg["policy"]]["predicted"],
                            "host_adjusted_error": adjusted[agg["policy"]]["error"]} if adjusted else {})
                        | ({"link_adjusted_tok_s": linked[agg["policy"]]["predicted"],
                            "link_adjusted_error": linked[agg["policy"]]["error"]} if agg["policy"] in linked else {})
                        | ({"cpu_adjusted_tok_s": cpus[agg["policy"]]["predicted"],
                            "cpu_adjusted_error": cpus[agg["policy"]]["error"]} if agg["policy"] in cpus else {})
                        | ({"cpu_ref_adjusted_tok_s": refs[agg["policy"]]["predicted"],
                            "cpu_ref_adjusted_error": refs[agg["policy"]]["error"]} if agg["policy"] in refs else {})
                        | ({"other_profile_tok_s": others[agg["policy"]]["predicted"]} if agg["policy"] in others else {}))
    summary = {k: res[k] for k in ("date", "card", "torch", "commit", "spec", "tokens")} | {
        "profile": prof.name, "rows": rows, "omp_env": res.get("omp_env")} | ({"other_profile": str(a.against)} if other else {})
    write_text_atomic(a.out, json.dumps(summary, indent=1))
    print(table(rows))
    if any(not host_timed(r["policy"]) and any(r["host_speed"]) for r in rows):
        print(HOST_NOTE)
    if any(any(r.get("boundary_speed") or []) for r in rows):
        print(BOUNDARY_NOTE)
    print(counts(rows))
    if "omp_env" in res:                  # validate_h200 records it from the thirtieth session on
        print("OpenMP settings of the runs: " + (", ".join(f"{k}={v}" for k, v in res["omp_env"].items()) or "the defaults"))
    if other is not None:
        n, beyond = calibrations_agree(rows)
        both = sum("other_profile_tok_s" in r for r in rows)    # the rows the other calibration could price
        print(f"the two calibrations predict {n} of {both} within 2% of each other"
              + (f" ({len(rows) - both} rows it cannot price left out)" if both < len(rows) else "") + "; beyond: "
              + ("; ".join(f"pool {p:g} batch {b} {pol} {d * 100:+.1f}%" for p, b, pol, d in beyond) or "none"))


def counts(rows: list[dict]) -> str:
    """The issue-15 tallies: rows within 3, 5 and 10% end to end, and rows whose every layer's mean
    time is within 8% (host-adjusted too where it was asked for)."""
    n = len(rows)
    within = lambda key, t: sum(abs(r[key]) <= t for r in rows if key in r)  # noqa: E731
    layers = sum(all(abs(x) <= 0.08 for x in r["layer_mean_error_worst"]) for r in rows)
    line = (f"{n} configurations: {within('error', .03)} within 3%, {within('error', .05)} within 5%, "
            f"{within('error', .10)} within 10%; every layer within 8% in {layers}")
    if all("layer_mean_error_worst_past_first" in r for r in rows):     # the first holds the pass boundary
        past = sum(all(abs(x) <= 0.08 for x in r["layer_mean_error_worst_past_first"]) for r in rows)
        line += f" (every layer past the first in {past})"
    twice = [r["layer_repeats"]["within"] for r in rows if "layer_repeats" in r]
    if twice:
        line += (f"; every layer within 8% of the runs' mean or inside their range widened by 8% in "
                 f"{sum(w is True for w in twice)} of the {len(twice)} run more than once")
    if any("host_adjusted_error" in r for r in rows):
        line += (f"; at the runs' host speed {within('host_adjusted_error', .03)} / {within('host_adjusted_error', .05)}"
                 f" / {within('host_adjusted_error', .10)}")
    if any("link_adjusted_error" in r for r in rows):
        linked = lambda t: sum(abs(r.get("link_adjusted_error", r["error"])) <= t for r in rows)  # noqa: E731
        line += (f"; at the runs' link speed (the rows without loads as they are) {linked(.03)} / {linked(.05)}"
                 f" / {linked(.10)}")
    if any("cpu_adjusted_error" in r for r in rows):
        cpu = lambda t: sum(abs(r.get("cpu_adjusted_error", r["error"])) <= t for r in rows)  # noqa: E731
        line += f"; with the CPU experts at their runs' speed (the rest as they are) {cpu(.03)} / {cpu(.05)} / {cpu(.10)}"
    if any("cpu_ref_adjusted_error" in r for r in rows):
        ref = lambda t: sum(abs(r.get("cpu_ref_adjusted_error", r["error"])) <= t for r in rows)  # noqa: E731
        line += (f"; with the host at the CPU loop's speed around its runs (the rows without it as they are) "
                 f"{ref(.03)} / {ref(.05)} / {ref(.10)}")
    if note := states_note([{"slow_host": s} for r in rows for s in r.get("slow_host") or []]):
        line += "; " + note
    if note := cpu_ref_reading(rows):
        line += "; " + note
    return line


def cpu_ref_reading(rows: list[dict]) -> str | None:
    """`cmoe run`'s line on the CPU's plain loop over the rows' runs (`cmoe.core.cpu_ref`; None where
    no run and profile recorded it), with its r against the runs' host speed where three runs or
    more have both: whether the host's misses follow the CPU's own speed."""
    note = cpu_ref_note([k for r in rows for k in r.get("cpu_ref") or []])
    both = [(k, h) for r in rows for k, h in zip(r.get("cpu_ref") or [], r["host_speed"])
            if k is not None and h is not None]
    if note and len(both) >= 3 and len({k for k, _ in both}) > 1 and len({h for _, h in both}) > 1:
        r = float(np.corrcoef(*zip(*both))[0, 1])
        note += f" (r {r:.2f} with their host's time a layer over its calibration, {len(both)} runs)"
    return note


HOST_NOTE = ("* host, run / calibration: calibrate does not time this policy's host step (`upper` has none, "
             "`commit` plans behind its experts); shown for reference, and cmoe run's verdict leaves it out")


BOUNDARY_NOTE = ("pass boundary, run / model: the host's LM-head step and the next pass's start as calibrate reads "
                 "them, over what the model charges for them (`cmoe.analysis.boundary`); where the GPU catches the "
                 "host, layer 0 follows it; - where a policy reads nothing back (its host runs ahead)")


def table(rows: list[dict]) -> str:
    adj = any("host_adjusted_tok_s" in r for r in rows)
    ladj = any("link_adjusted_tok_s" in r for r in rows)
    cadj = any("cpu_adjusted_tok_s" in r for r in rows)
    out = ["| pool GB (experts) | batch | policy | predicted tok/s | measured tok/s | error | runs' spread "
           "| TPOT ms pred / meas | worst layer (mean time) | layer MAPE | host, run / calibration "
           "| link, run / calibration (loads under 80% of it) | pass boundary, run / model |"
           + (" predicted at the runs' host speed | error |" if adj else "")
           + (" predicted at the runs' link speed | error |" if ladj else "")
           + (" CPU experts, run / calibration (share slow at its factor) | predicted at their speed | error |" if cadj else ""),
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
           + (" ---: | ---: |" if adj else "") + (" ---: | ---: |" if ladj else "") + (" ---: | ---: | ---: |" if cadj else "")]
    for r in rows:
        meas = " / ".join(f"{x:.1f}" for x in r["measured_tok_s"])
        spread = f"{r['spread'] * 100:.0f}%" if len(r["measured_tok_s"]) > 1 else "- (one run)"
        worst = " / ".join(f"{x * 100:+.0f}%" + (f" (L{w})" if w is not None else "")
                           for x, w in zip(r["layer_mean_error_worst"], r["layer_worst"]))
        mape = " / ".join(f"{x * 100:.0f}%" for x in r["layer_mape_mean"])
        star = "" if host_timed(r["policy"]) else "*"       # `HOST_NOTE`
        host = " / ".join(f"{x:.2f}x{star}" if x else "-" for x in r["host_speed"])
        link = " / ".join(f"{x:.3f}x" + (f" ({w:.0%} slow)" if w is not None else "") if x else "-"
                          for x, w in zip_longest(r.get("link_speed", []), r.get("slow_loads", [])))
        bound = " / ".join(f"{x:.2f}x" if x else "-" for x in r.get("boundary_speed") or [None])
        line = (f"| {r['pool_gb']:g} ({r['experts_fit']}) | {r['batch']} | {r['policy']} | {r['predicted_tok_s']:.1f} "
                f"| {meas} | {r['error'] * 100:+.1f}% | {spread} "
                f"| {r['predicted_tpot_ms']:.1f} / {r['measured_tpot_ms']:.1f} | {worst} | {mape} | {host} | {link or '-'} "
                f"| {bound} |")
        if adj:
            line += (f" {r['host_adjusted_tok_s']:.1f} | {r['host_adjusted_error'] * 100:+.1f}% |"
                     if "host_adjusted_tok_s" in r else " - | - |")
        if ladj:
            line += (f" {r['link_adjusted_tok_s']:.1f} | {r['link_adjusted_error'] * 100:+.1f}% |"
                     if "link_adjusted_tok_s" in r else " - | - |")
        if cadj:
            cpu = " / ".join(f"{x:.2f}x" + (f" ({w['share']:.0%} at {w['factor']:.2f}x)" if w else "")
                             for x, w in zip_longest(r.get("cpu_speed", []), r.get("slow_cpu", [])) if x)
            line += (f" {cpu} | {r['cpu_adjusted_tok_s']:.1f} | {r['cpu_adjusted_error'] * 100:+.1f}% |"
                     if "cpu_adjusted_tok_s" in r else " - | - | - |")
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    from cmoe.core.errors import CmoeError
    try:
        main()
    except CmoeError as e:                     # one line, no traceback
        sys.exit(f"validate_table.py: {e}")
