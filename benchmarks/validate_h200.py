"""Predicted against measured on a GPU (issue 5): calibrate once on this card, then for each pool
size and batch simulate and execute every policy over the same trace and validate the pair.

What `cmoe run` does for one configuration, done for several with one calibration and one host
store (building Mixtral-8x7B's 256 int4 experts takes half a minute; the configurations differ
only in pool and batch). Writes, under --out:
- profile.json, profile.measurements.json: the calibration (under --calibrate-on both also
  profile-cut.json and its measurements: the cut model's, held against the same runs);
- pool{GB}-b{B}/predicted, .../measured (run folders as cmoe simulate/execute write them, without
  the Chrome traces), .../validation.json;
- results.json: per configuration and policy, predicted and measured tokens/s and mean time per
  token with the errors; rewritten after every configuration, so a run cut short keeps its figures;
- host-load.json: the host's other load and steal every 0.1 s from the store's build on
  (`cmoe.calibrate.host_load`), rewritten with results.json.
With --profile PATH it calibrates nothing and uses that profile (e.g. a second pass with the
same calibration), copied to profile.json under --out so the folder predicts on its own (the
forty-sixth session's calibration took 251 s on an H100, leaving batch 8 to a second call).
Needs simpy for the predictions (without it only the measured side is written).
On a GPU machine it sets OMP_WAIT_POLICY=ACTIVE before torch loads, unless the variable is given,
where --policies names a CPU-expert policy, as `cmoe run` does (`cmoe.executor.omp_wait`); until
the thirty-seventh session it set it for every validation, since its calibration measures CPU
experts, and a validation of GPU-only policies ran its calibration and runs beside a team
spinning on all 16 cores, which slowed such runs 0.7-1.3% (`benchmarks/sampler_ab_h200.py`,
BENCHMARKS.md). results.json records it (`omp_env`, `omp_wait`).

    python benchmarks/validate_h200.py --out $OUT --pools 20,26 --batches 1,8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.affinity import ENV as PIN_ENV  # noqa: E402  (pure: no torch)
from cmoe.executor.omp_wait import spin_threads  # noqa: E402  (before torch: libgomp reads it on load)
from cmoe.policy.policies import POLICIES, any_trait  # noqa: E402  (pure: no torch)


def compile_cache_files() -> dict[str, int]:
    """How many files Triton's and numba's on-disk caches held as this process started: a fresh machine
    compiles every kernel in its first calibration (~40-70 s more on an H100), a warm one or a carried
    .kcache/ (gpu_session.sh KCACHE=1) does not, so a slow calibration says which it was."""
    triton = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    numba = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else Path("cmoe")
    return {"triton": sum(1 for f in triton.rglob("*") if f.is_file()) if triton.is_dir() else 0,
            "numba": sum(1 for _ in numba.rglob("*.nbi")) if numba.is_dir() else 0}


def _named_policies(argv: list[str]) -> list[str]:
    """--policies as `main`'s parser will read it (the last one given; no abbreviations, there or
    here), or every policy: read before torch loads, to know whether CPU experts run."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--policies", default=",".join(POLICIES))
    return ap.parse_known_args(argv)[0].policies.split(",")


SPIN = spin_threads("auto", any_trait(_named_policies(sys.argv[1:]), "cpu_experts"))   # as `cmoe run`

import torch  # noqa: E402

from cmoe.executor.run import ExecConfig, build, prepare, run_policy  # noqa: E402
from cmoe.executor.run import write_outputs as write_exec  # noqa: E402
from cmoe.core.util import write_text_atomic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)      # as `_named_policies` reads --policies
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pools", default="20,26")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--spec", default="mixtral-8x7b")
    ap.add_argument("--embedded", action="store_true", help="the embedded trained model and its trace instead "
                    "(a quick check of this script on the CPU: --device cpu --slots 4)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers built for calibrating")
    ap.add_argument("--calibrate-on", choices=("cut", "built", "both"), default="cut",
                    help="cut: the preset cut to --layers layers, built by calibrate itself (as `cmoe calibrate` "
                    "does; the same per-layer shapes, an eighth of the runs' time); built: the full model built "
                    "for the runs (`cmoe run`'s way; its GPU-time runs hold each of 32 layers back 5 ms); both: "
                    "the cut first (profile-cut.json, a comparison on the same runs), then the built one, which "
                    "predicts (the cut's stands in, said so in results.json, if the built one fails)")
    ap.add_argument("--commit", default=None, help="the commit being run, where git cannot say (the GPU "
                    "machine's copy of the tree keeps the .git of the session's start)")
    ap.add_argument("--measure-only", action="store_true", help="no predictions here even with simpy installed "
                    "(the simulator is deterministic: benchmarks/validate_table.py predicts anywhere)")
    ap.add_argument("--repeat", action="store_true", help="run the policies again in reverse order (measured-2/): "
                    "how far two runs of the same configuration differ")
    a = ap.parse_args()
    policies = tuple(a.policies.split(","))
    if a.profile:                         # refuse what validate_table could not price, before the build
        from cmoe.sim.priced import check_profile
        check_profile(a.profile, policies)
    a.out.mkdir(parents=True, exist_ok=True)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    dirty = "" if a.commit else subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True).stdout.strip()
    card = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    from cmoe.calibrate.measure import host_cpu
    res = {"date": time.strftime("%Y-%m-%d"), "card": card, "host": host_cpu(), "torch": torch.__version__,
           "commit": commit + ("+dirty" if dirty else ""), "spec": a.spec, "tokens": a.tokens, "configs": [],
           # the OpenMP settings the CPU experts ran under (the wait policy moves them 1.5-1.9x: BENCHMARKS.md)
           "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
           "omp_wait": SPIN, "compile_cache_files": compile_cache_files(),
           "pin_host": os.environ.get(PIN_ENV, "")}      # the passes' thread on one core (`cmoe.executor.affinity`)
    import importlib.util
    can_predict = importlib.util.find_spec("simpy") is not None and not a.measure_only
    if not can_predict:
        print("measuring only (benchmarks/validate_table.py predicts from the profile anywhere)", flush=True)

    if a.embedded:
        from cmoe.data import default_model
        where = {"spec_name": None, "model_dir": default_model(), "trace_src": "embedded", "data": None}
    else:
        where = {"spec_name": a.spec, "model_dir": None, "trace_src": f"synthetic:{a.spec}", "data": None}
    setup = {"tokens": a.tokens, "device": a.device, "slots": a.slots}
    first = ExecConfig(policies=policies, pool_gb=float(a.pools.split(",")[0]), batch=1, **setup)
    w, _ = prepare(cfg=first, **where)
    # what validate_table.py replays: the model's shapes and trace as run (the embedded model is no preset)
    res |= {"spec": w.spec.name, "trace": where["trace_src"], "model": where["model_dir"] and str(where["model_dir"]),
            "expert_format": w.fmt, "slots": a.slots}
    from cmoe.calibrate.host_load import LoadSampler
    load = LoadSampler(0.1).start()
    t0 = time.perf_counter()
    build(w, first)
    res["build_s"] = time.perf_counter() - t0
    print(f"built store ({w.store.nbytes / 1e9:.1f} GB pinned) and model in {res['build_s']:.0f} s", flush=True)
    print(SPIN, flush=True)
    if a.profile:
        from cmoe.core.hw import load_profile
        prof = load_profile(a.profile)
        res["profile_from"] = str(a.profile)
        write_text_atomic(a.out / "profile.json", json.dumps(prof.to_dict(), indent=1))
    else:                                 # as cmoe run does: on this machine, on the model just built
        prof = _calibrate(a, w, where, card, res)
    built = (w.store, w.model, w.shims)

    for batch in [int(b) for b in a.batches.split(",")]:
        warm = True
        for pool in [float(p) for p in a.pools.split(",")]:
            cfg = ExecConfig(policies=policies, pool_gb=pool, batch=batch, **setup)
            w, cfg = prepare(cfg=cfg, **where)
            w.store, w.model, w.shims = built
            if warm:                          # untimed: kernels, allocator, every KV length of this batch
                run_policy(w, cfg, "upper")
                warm = False
            here = a.out / f"pool{pool:g}-b{batch}"
            if can_predict:
                from cmoe.pipeline import predict
                predict(w, cfg, prof, here / "predicted")
            results, again = [], []
            for p in policies:
                results.append(_timed(w, cfg, p, f"pool {pool:g} batch {batch}"))
            write_exec(here / "measured", results)
            if a.repeat:
                for p in reversed(policies):
                    again.append(_timed(w, cfg, p, f"pool {pool:g} batch {batch} again"))
                write_exec(here / "measured-2", again)
            for f in (here / "measured").glob("timeline-*.json"):
                f.unlink()                    # the Chrome traces: large, and made again from the Parquet
            for f in (here / "measured-2").glob("timeline-*.json"):
                f.unlink()
            entry = {"pool_gb": pool, "batch": batch, "experts_fit": results[0].metrics["experts_fit"]
                     if policies[0] != "upper" else results[-1].metrics["experts_fit"], "policies": {}}
            for r in results:
                entry["policies"][r.policy] = {"measured_tok_s": r.metrics["tokens_per_s"],
                                               "measured_tpot_ms": r.metrics["tpot_ms_mean"],
                                               "wall": r.metrics["wall"]}
            for r in again:
                entry["policies"][r.policy].update(again_tok_s=r.metrics["tokens_per_s"], again_wall=r.metrics["wall"])
            if can_predict:
                from cmoe.analysis.validate import format_validation, validate_folders
                for f in (here / "predicted").glob("timeline-*.json"):
                    f.unlink()
                vals = validate_folders(here / "predicted", here / "measured", list(policies))
                write_text_atomic(here / "validation.json", json.dumps(vals, indent=1))
                for v in vals:
                    print(format_validation(v), flush=True)
                    e = entry["policies"][v["policy"]]
                    e.update(predicted_tok_s=v["tokens_per_s"]["predicted"], error=v["tokens_per_s"]["error"],
                             predicted_tpot_ms=v["per_token"]["pred_mean_us"] / 1e3,
                             tpot_mape=v["per_token"]["mape"], layer_mape_mean=v["per_layer_mape_mean"],
                             layer_mape_max=v["per_layer_mape_max"], error_from=v["error_from"])
            res["configs"].append(entry)
            write_text_atomic(a.out / "results.json", json.dumps(res, indent=1))
            _write_load(a.out, load)
            del results
            if w.device.type == "cuda":
                torch.cuda.empty_cache()


def _calibrate(a, w, where: dict, card: str, res: dict):
    """The profile that predicts, calibrated here as --calibrate-on says; under `both` the cut's
    profile is written beside it as profile-cut.json (the same runs held against two
    calibrations: what the model's depth changes in the host's costs)."""
    from cmoe.calibrate.measure import calibrate
    from cmoe.calibrate.beside import beside
    name = f"calibrated-{card.split()[-1].lower()}"
    ways = ("cut", "built") if a.calibrate_on == "both" else (a.calibrate_on,)
    prof = None
    for way in ways:
        t0 = time.perf_counter()
        try:
            p, m = calibrate(w.device, w.spec, w.fmt, a.layers, where["model_dir"], name=name,   # the cut as
                             built=w if way == "built" else None,                       # the built: CPU
                             cpu_experts=any_trait(a.policies.split(","), "cpu_experts"))   # copies or not
        except Exception as e:                   # noqa: BLE001  (a benchmark: the cut's profile stands in)
            if prof is None:
                raise
            print(f"calibrating on the {way} model failed ({type(e).__name__}: {e}); the cut's profile predicts",
                  flush=True)
            res["calibrated_on"] = f"cut (built failed: {type(e).__name__}: {e})"
            write_text_atomic(a.out / "profile.json", json.dumps(prof.to_dict(), indent=1))
            break
        res[f"calibrate_{way}_s" if len(ways) > 1 else "calibrate_s"] = time.perf_counter() - t0
        print(f"calibrated on the {way} model in {time.perf_counter() - t0:.0f} s; steps of 5 s or more: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in m.get("seconds", {}).items() if v >= 5), flush=True)
        print(beside(p, m), flush=True)
        stem = "profile-cut" if len(ways) > 1 and way == "cut" else "profile"
        write_text_atomic(a.out / f"{stem}.json", json.dumps(p.to_dict(), indent=1))
        write_text_atomic(a.out / f"{stem}.measurements.json", json.dumps(m, indent=1))
        res["calibrated_on"] = way
        prof = p
        if w.device.type == "cuda":
            torch.cuda.empty_cache()
    return prof


def _write_load(out: Path, load) -> None:
    """host-load.json: the sampler's windows so far, figures to 4 places."""
    rows = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in load.windows()]
    write_text_atomic(out / "host-load.json", json.dumps({"interval_s": load.interval, "windows": rows}))


def _timed(w, cfg, policy: str, what: str):
    t0, w0 = time.perf_counter(), time.time()
    r = run_policy(w, cfg, policy)
    r.metrics["wall"] = (w0, time.time())         # epoch seconds: lines up with a clock log taken beside
    r.metrics["clock_epoch"] = r.log.clock_epoch   # the timeline's zero on the same clock (host-load.json's)
    print(f"{what} {policy:<13} {r.metrics['tokens_per_s']:8.2f} tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
    return r


if __name__ == "__main__":
    from cmoe.core.errors import CmoeError
    try:
        main()
    except CmoeError as e:                     # one line, no traceback
        sys.exit(f"validate_h200.py: {e}")
