"""`cmoe run`: calibrate (or take a profile), simulate, execute and validate one configuration, so
a user with a GPU sees predicted and measured side by side from one command.

This is orchestration, beside the CLI on the top floor: the one module that calls both engines.
The simulation is made to describe exactly what the executor runs: the same trace object, the
executor's expert format and bf16 non-expert weights for the memory budget (so both cut the pool
into the same slots), the same batch and pool.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cmoe.core.util import atomic_dir, check_output, host_program_on, write_text_atomic

# What marks a folder as one `cmoe run` wrote (--force replaces only those).
RUN_ALL_FOLDER = ("validation.json", "predicted", "measured", "profile.json")


def run_all(out: Path, *, spec_name: str | None, model_dir: Path | None, trace_src: str | None, policies: tuple[str, ...],
            pool_gb: float, batch: int, tokens: int, quant: str | None, device: str, profile: str | None,
            slots: int | None = None, layers: int = 4, repeat: int = 1, echo=print, force: bool = False,
            detail=None, progress: bool = True) -> dict:
    """Everything goes into `out`, built under a temporary name and renamed into place at the end
    (`force`: replace an existing one whole), so an error or a Ctrl-C leaves nothing partial.
    `echo` gets what a person needs (a note on the defaults, the summary: `summary_text`),
    `detail` the long sections as they come (calibration table, both engines' tables, every
    policy's validation; default: echo). Returns the summary document (`summary_doc`)."""
    detail = echo if detail is None else detail
    check_output(out, force, folder=True, marker=RUN_ALL_FOLDER)      # before torch is even imported
    if profile is not None:                  # refuse what it cannot price before the long build
        from cmoe.sim.priced import check_profile
        check_profile(profile, policies)
    from cmoe.executor.run import ExecConfig, prepare
    from cmoe.report.build import report_line
    if spec_name is None and model_dir is None:          # the embedded trained model and its trace
        from cmoe.data import default_model
        model_dir, trace_src = default_model(), trace_src or "embedded"
        if slots is None:
            slots = 4
            echo("the embedded model (8 experts per layer) with 4 expert slots per layer (--slots to change)")
    cfg = ExecConfig(policies=policies, pool_gb=pool_gb, batch=batch, tokens=tokens, device=device, quant=quant,
                     slots=slots, progress=progress)
    w, cfg = prepare(spec_name=spec_name, model_dir=model_dir, trace_src=trace_src or
                     (f"synthetic:{spec_name}" if spec_name else None), data=None, cfg=cfg)
    if w.trace is None:
        from cmoe.core.errors import CmoeError
        raise CmoeError("cmoe run needs a trace to replay (--trace), so that both engines see the same routing")
    with atomic_dir(out, force, RUN_ALL_FOLDER) as tmp:
        doc = _run_into(tmp, out, w, cfg, profile, model_dir, layers, repeat, detail)
    doc["report"] = report_line([out / "predicted", out / "measured"], out / "report.html")
    doc["out"] = str(out)
    echo(summary_text(doc))
    return doc


def _run_into(out: Path, final: Path, w, cfg, profile: str | None, model_dir: Path | None, layers: int, repeat: int,
              echo) -> dict:
    """Calibrate (or take the profile), simulate, execute and validate, writing into `out`: the
    temporary folder that becomes `final`."""
    from cmoe.executor.run import build, execute
    from cmoe.executor.run import table as exec_table
    from cmoe.executor.run import write_outputs as write_exec
    from cmoe.core.hw import load_profile
    from cmoe.sim.api import table as sim_table
    from cmoe.analysis.validate import format_validation, validate_folders
    from cmoe.policy.policies import any_trait
    cpu = any_trait(cfg.policies, "cpu_experts")     # else the calibration's CPU experts are shown, not judged
    build(w, cfg)
    if profile is None:                                   # calibrate once, on this machine and this model
        from cmoe.calibrate.measure import calibrate
        from cmoe.calibrate.beside import beside
        from cmoe.calibrate.profile_fit import noise_of
        prof, m = calibrate(w.device, w.spec, w.fmt, layers, model_dir, name=f"calibrated-{w.device.type}", built=w,
                            progress=cfg.progress)
        echo(beside(prof, m))
        cal = noise_of(m, cpu)
        echo(cal.line())
        write_text_atomic(out / "profile.json", json.dumps(prof.to_dict(), indent=1))
        write_text_atomic(out / "profile.measurements.json", json.dumps(m, indent=1))
        echo(f"wrote {final / 'profile.json'}")
    else:
        prof, cal = load_profile(profile), _profile_noise(profile, cpu)
    sims = predict(w, cfg, prof, out / "predicted")
    echo("predicted:\n" + sim_table(sims))
    results = execute(w, cfg)
    write_exec(out / "measured", results)
    echo("measured:\n" + exec_table(results))
    vals = validate_folders(out / "predicted", out / "measured", list(cfg.policies))
    for v in vals:
        echo(format_validation(v))
    doc: object = vals
    errors, spreads = [v["tokens_per_s"]["error"] for v in vals], None
    runs = [vals]
    if repeat > 1:                      # the same configuration again, policies in reverse order each time
        from cmoe.executor.run import run_policy
        from cmoe.analysis.validate import against_repeats, format_repeats
        for k in range(2, repeat + 1):
            again = [run_policy(w, cfg, p) for p in reversed(cfg.policies)][::-1]
            write_exec(out / f"measured-{k}", again)
            runs.append(validate_folders(out / "predicted", out / f"measured-{k}", list(cfg.policies)))
        rows = against_repeats(runs)
        echo(f"against the mean of {repeat} measured runs (the machine's own noise is the spread):\n"
             + format_repeats(rows))
        doc = {"runs": runs, "against_mean": rows}
        errors, spreads = [r["error"] for r in rows], [r["spread"] for r in rows]
    from cmoe.calibrate.profile_fit import run_verdict
    write_text_atomic(out / "validation.json", json.dumps(doc, indent=1))
    host, link, cpu_took = host_speed(runs, prof, cfg.batch), link_speed(runs), cpu_speed(runs)
    notes = run_notes(runs)
    noise = run_verdict(cal, errors, spreads, host or None, link or None, cpu_took or None)
    return summary_doc(w, cfg, sims, results, errors, "; ".join([noise, *notes]))


def run_notes(runs: list[list[dict]]) -> list[str]:
    """What `cmoe run` says of its validations beside the noise verdict, without -v too: the
    settings the runs and the profile differ in, the host lane's two states, the CPU's own speed."""
    from cmoe.analysis.cpu_settings import setting_notes
    from cmoe.analysis.states import states_note
    from cmoe.core.cpu_ref import cpu_ref_note, validation_ratio
    vs = [v for r in runs for v in r]
    notes = sorted({n.strip() for v in vs for n in setting_notes(v)})
    return notes + [n for n in [states_note(vs), cpu_ref_note([validation_ratio(v) for v in vs])] if n]


def host_speed(runs: list[list[dict]], prof, batch: int) -> list[float]:
    """Each measured run's host time per layer (`host_layer_us` of its validation) over the
    profile's (`host_layer` at the batch): > 1, the host ran slower than when it was calibrated.
    Only the policies whose host step is the one calibrate times (a read-back every layer): not
    `upper`, which has no host step on the lean engine, nor the committing policies, which plan
    behind their experts (on the H200, sixth session, `upper` ran at 0.39-1.36x its calibration
    and `commit` at 1.02-4.11x, where the others ran at 0.58-2.62x)."""
    return [x for r in runs for v in r if (x := host_ratio(v, prof, batch)) is not None and host_timed(v["policy"])]


def host_timed(policy: str) -> bool:
    """Is the policy's host step the one calibrate times (`host_speed`)? Not `upper`'s (it has none
    on the lean engine) nor the committing policies' (they plan behind their experts)."""
    from cmoe.policy.policies import trait
    return not trait(policy, "holds_all") and not trait(policy, "commits")


def host_ratio(v: dict, prof, batch: int) -> float | None:
    """One validation's (`cmoe.analysis.validate.validate`) host time per layer over the
    profile's `host_layer` at the batch (the Python step's where the run planned in it: its
    `host_program` false, `cmoe.policy.policies.python_step`); None where either is missing."""
    from cmoe.policy.policies import python_step
    stepped = python_step(v.get("policy", ""), v.get("host_program") is not False)
    base = (prof.python_step() if stepped else prof).host_layer(batch)
    return v["host_layer_us"] / base if v.get("host_layer_us") and base > 0 else None


def link_speed(runs: list[list[dict]]) -> list[float]:
    """Each measured run's link rate over its prediction's (`cmoe.analysis.validate.link_ratio`):
    the bandwidth its expert loads moved at against the calibrated curve's at the same sizes; only
    the runs that loaded anything."""
    from cmoe.analysis.validate import link_ratio
    return [x for r in runs for v in r if (x := link_ratio(v)) is not None]


def cpu_speed(runs: list[list[dict]]) -> list[float]:
    """Each measured run's CPU expert time over its prediction's (`cmoe.analysis.validate.cpu_ratio`):
    only the runs that put experts on the CPU."""
    from cmoe.analysis.validate import cpu_ratio
    return [x for r in runs for v in r if (x := cpu_ratio(v)) is not None]


def summary_doc(w, cfg, sims, results, errors, noise: str) -> dict:
    """What `cmoe run` opens with (and prints with --json): per policy, predicted and measured
    tokens/s and the error, the measured ratio to upper and to oracle, hits and loads."""
    meas = {r.policy: r.metrics for r in results}
    rows = []
    for s, err in zip(sims, errors):
        p, m = s.config.policy, meas[s.config.policy]
        rows.append({"policy": p, "predicted_tok_s": s.metrics["tokens_per_s"], "measured_tok_s": m["tokens_per_s"],
                     "error": err, "hit_rate": m["hit_rate"], "loads": m["loads"], "fallbacks": m["fallbacks"],
                     "skipped": m["skipped"]})
    for bound in ("upper", "oracle"):
        ref = meas.get(bound, {}).get("tokens_per_s")
        for r in rows:
            r[f"x_{bound}"] = r["measured_tok_s"] / ref if ref else None
    # the decode steps the runs took: fewer than asked where the trace's first batch ends before them
    steps = min((int(r.metrics["decode_passes"]) for r in results), default=cfg.tokens)
    return {"model": w.spec.name, "device": w.device.type, "batch": cfg.batch, "decode_tokens": steps,
            **({"tokens_asked": cfg.tokens} if steps < cfg.tokens else {}),
            "pool_gb": cfg.pool_gb, "slots": cfg.slots, "expert_format": w.fmt, "policies": rows, "noise": noise}


def summary_text(doc: dict) -> str:
    """A screenful: the fastest policy against the bounds, one row per policy, the noise verdict."""
    rows = doc["policies"]
    best = max(rows, key=lambda r: r["measured_tok_s"])
    ratio = lambda r, b: f"{r[b]:.2f}x {b[2:]}" if r[b] is not None else None  # noqa: E731
    against = ", ".join(x for x in (ratio(best, "x_upper"), ratio(best, "x_oracle")) if x)
    errs = [abs(r["error"]) for r in rows]
    asked = f" (the trace's first batch ends there; {doc['tokens_asked']} asked)" if doc.get("tokens_asked") else ""
    lines = [f"{doc['model']} on {doc['device']}, batch {doc['batch']}, {doc['decode_tokens']} decode tokens{asked}, "
             f"{doc['expert_format']} experts: fastest measured {best['policy']} at {best['measured_tok_s']:.1f} tok/s"
             + (f" ({against})" if against else "") + f"; predicted within {max(errs) * 100:.1f}% "
             f"(mean {sum(errs) / len(errs) * 100:.1f}%)",
             f"{'policy':<14} {'predicted':>10} {'measured':>9} {'error':>7} {'x upper':>7} {'x oracle':>8} "
             f"{'hit':>6} {'loads':>6} {'fallback':>8} {'skipped':>7}"]
    for r in rows:
        x = lambda k: f"{r[k]:.2f}" if r[k] is not None else "-"  # noqa: E731
        lines.append(f"{r['policy']:<14} {r['predicted_tok_s']:10.1f} {r['measured_tok_s']:9.1f} {r['error'] * 100:+6.1f}% "
                     f"{x('x_upper'):>7} {x('x_oracle'):>8} {r['hit_rate']:6.3f} {r['loads']:6d} {r['fallbacks']:8d} "
                     f"{r['skipped']:7d}")
    lines += ["(tokens/s over decode passes, predicted and measured; hit, loads, fallback, skipped: measured)",
              doc["noise"], f"{doc['report']}; calibration, both engines' tables and per-layer errors: "
              f"{doc['out']}/validation.json, or --verbose"]
    return "\n".join(lines)


def _profile_noise(profile: str, cpu_experts: bool = True):
    """The noise verdict of a profile file's calibration, from the measurements calibrate wrote
    beside it; None for a built-in profile or a file without them."""
    from cmoe.calibrate.profile_fit import noise_of
    raw = Path(profile).with_suffix(".measurements.json")
    if not raw.is_file():
        return None
    try:
        return noise_of(json.loads(raw.read_text()), cpu_experts)
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return None                     # not calibrate's: the verdict says the noise is unknown


def predict(w, cfg, prof, out: Path) -> list:
    """Simulate exactly what the executor will run (its trace, expert format, bf16 non-expert
    weights, batch, pool and slots, and its passes: the first batch of requests, `--tokens`
    decode steps) under every policy of `cfg`, and write the run folder."""
    from cmoe.executor.run import budget_recipe
    from cmoe.core.quant import expert_bytes
    from cmoe.policy.policies import python_step
    from cmoe.sim.api import write_outputs as write_sim
    from cmoe.sim.run import SimConfig, simulate
    rec = budget_recipe(w.fmt)
    t = replace(w.trace, recipe=rec, expert_bytes=expert_bytes(w.spec, rec))
    stepped = getattr(cfg, "python_step", None)     # the policies the runs planned in Python, where known
    if stepped is None:
        stepped = {p for p in cfg.policies if python_step(p, host_program_on())}
    sims = [simulate(t, prof, SimConfig(policy=p, pool_gb=cfg.pool_gb, batch=cfg.batch, slots=cfg.slots,
                                        include_prefill=cfg.include_prefill, groups=1, decode_steps=cfg.tokens,
                                        python_step=p in stepped))
            for p in cfg.policies]
    write_sim(out, t, prof, sims)
    return sims
