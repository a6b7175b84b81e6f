"""Two fits of one calibration, judged against the same measured runs: for each folder `cmoe run`
wrote on the embedded default (any batch), the profile it used (`profile.json`, fitted by the tree
that ran) and a refit of its own measurements by this tree (`profile.measurements.json`), each
simulated over exactly what was executed and validated against the folder's `measured/` runs.
Nothing is run again, so the two columns differ by the fit alone, not by the host's noise.

    python benchmarks/refit_ab.py RUN [RUN ...] [--drop KEY] [--rounds] [--trace BUNDLE] [--out ab.json]

Prints, per folder, each policy's error end to end under both profiles (predicted over measured
tokens/s, minus one) and the mean and largest absolute error of each. `--drop KEY` adds a third:
the refit with the measurements' `layer` entry KEY left out (`load_copy`: the CPU's link from its
copy curve, as before 8f9ca28), so one measured term's worth is read over the same runs.
`--rounds` adds the refit whose layer points are the host's rounds' means ("host, layer" under
`repeats`), what `host_runs.cpu_lanes` makes a CPU calibration keep (the experts' points and the
pass start are not in the files, so only the layer's part of that change is read).
`--trace BUNDLE`: runs of the embedded model over that trace (`cmoe run --model cmoe/data/tiny-moe
--trace BUNDLE`, slots from the pool) instead of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _errors(w, cfg, prof, run: Path, scratch: Path) -> dict[str, float]:
    from cmoe.analysis.validate import validate_folders
    from cmoe.pipeline import predict
    predict(w, cfg, prof, scratch)
    return {v["policy"]: v["tokens_per_s"]["error"] for v in validate_folders(scratch, run / "measured", list(cfg.policies))}


def one(run: Path, scratch: Path, drop: str | None = None, rounds: bool = False, trace: str | None = None) -> dict:
    from cmoe.calibrate.profile_fit import fit_profile, refit_profile, with_expert_classes
    from cmoe.core.hw import H200
    from cmoe.core.hw import load_profile
    from cmoe.data import default_model
    from cmoe.executor.run import ExecConfig, prepare
    from cmoe.trace.bundle import fingerprint
    meta = json.loads((run / "measured" / "metrics.json").read_text())
    pols = tuple(r["policy"] for r in meta)
    first = meta[0]
    cfg = ExecConfig(policies=pols, pool_gb=float(first["pool_gb"]), batch=int(first["batch"]),
                     tokens=int(first["decode_passes"]), device="cpu", quant=None, slots=None if trace else 4,
                     progress=False)
    w, cfg = prepare(spec_name=None, model_dir=default_model(), trace_src=trace or "embedded", data=None, cfg=cfg)
    if trace and fingerprint(w.trace) != first["trace_id"]:
        sys.exit(f"{run} replayed trace {first['trace_id']}, not {trace}'s ({fingerprint(w.trace)})")
    refit, m = refit_profile(run / "profile.measurements.json")
    cols = {"stored fit": _errors(w, cfg, load_profile(str(run / "profile.json")), run, scratch / "a"),
            "this tree's refit": _errors(w, cfg, refit, run, scratch / "b")}
    variants = {}                                 # more refits of the same measurements, each edited one way
    if drop:
        if drop not in m["layer"]:
            sys.exit(f"{run}'s measurements hold no layer entry {drop!r}: nothing to leave out")
        variants[f"refit without {drop}"] = m | {"layer": {k: v for k, v in m["layer"].items() if k != drop}}
    if rounds:
        pts = [[b, sum(v) / len(v)] for b, v in m["repeats"]["host, layer"]["points"]]
        variants["layer from the rounds"] = m | {"layer": m["layer"] | {"points": pts}}
    for i, (name, mm) in enumerate(variants.items()):
        d = mm["device"]
        prof = with_expert_classes(fit_profile(d["label"], mm, d["memory_bytes"], d["label"], d["date"]), H200)
        cols[name] = _errors(w, cfg, prof, run, scratch / f"v{i}")
    return {"run": str(run), "batch": cfg.batch, "errors": cols}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--drop", default=None, help="also refit without this entry of the measurements' layer")
    ap.add_argument("--rounds", action="store_true", help="also refit with the layer points from the host's rounds")
    ap.add_argument("--trace", default=None, help="the trace the runs replayed (default: the embedded one)")
    a = ap.parse_args()
    for r in a.runs:
        if not (r / "profile.measurements.json").is_file() or not (r / "measured" / "metrics.json").is_file():
            sys.exit(f"{r} is not a folder `cmoe run` wrote with its own calibration (profile.measurements.json, "
                     "measured/): run `cmoe run --device cpu --out FOLDER` without --profile")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(a.runs):
            rows.append(one(r, Path(tmp) / str(i), a.drop, a.rounds, a.trace))
    for row in rows:
        print(f"{row['run']} (batch {row['batch']})")
        for name, errs in row["errors"].items():
            ab = [abs(e) for e in errs.values()]
            print(f"  {name:<24} mean {sum(ab) / len(ab) * 100:5.1f}%  largest {max(ab) * 100:5.1f}%  "
                  + " ".join(f"{p} {e * 100:+.1f}" for p, e in errs.items()))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
