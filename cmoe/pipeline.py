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

from cmoe.util import write_text_atomic


def run_all(out: Path, *, spec_name: str | None, model_dir: Path | None, trace_src: str | None, policies: tuple[str, ...],
            pool_gb: float, batch: int, tokens: int, quant: str | None, device: str, profile: str | None,
            slots: int | None = None, layers: int = 4, repeat: int = 1, echo=print) -> list[dict]:
    from cmoe.executor.run import ExecConfig, execute, prepare
    from cmoe.executor.run import table as exec_table
    from cmoe.executor.run import write_outputs as write_exec
    from cmoe.hw import load_profile
    from cmoe.report.build import report_line
    from cmoe.sim.api import table as sim_table
    from cmoe.validate import format_validation, validate_folders
    if spec_name is None and model_dir is None:          # the embedded trained model and its trace
        from cmoe.data import default_model
        model_dir, trace_src = default_model(), trace_src or "embedded"
        if slots is None:
            slots = 4
            echo("the embedded model (8 experts per layer) with 4 expert slots per layer (--slots to change)")
    cfg = ExecConfig(policies=policies, pool_gb=pool_gb, batch=batch, tokens=tokens, device=device, quant=quant,
                     slots=slots, progress=True)
    w, cfg = prepare(spec_name=spec_name, model_dir=model_dir, trace_src=trace_src or
                     (f"synthetic:{spec_name}" if spec_name else None), data=None, cfg=cfg)
    if w.trace is None:
        from cmoe.errors import CmoeError
        raise CmoeError("cmoe run needs a trace to replay (--trace), so that both engines see the same routing")
    out.mkdir(parents=True, exist_ok=True)
    from cmoe.executor.run import build
    build(w, cfg)
    if profile is None:                                   # calibrate once, on this machine and this model
        from cmoe.executor.measure import calibrate
        from cmoe.profile_fit import beside
        prof, m = calibrate(w.device, w.spec, w.fmt, layers, model_dir, name=f"calibrated-{w.device.type}", built=w)
        echo(beside(prof, m))
        write_text_atomic(out / "profile.json", json.dumps(prof.to_dict(), indent=1))
        write_text_atomic(out / "profile.measurements.json", json.dumps(m, indent=1))
        echo(f"wrote {out / 'profile.json'}")
    else:
        prof = load_profile(profile)
    sims = predict(w, cfg, prof, out / "predicted")
    echo("predicted:\n" + sim_table(sims))
    results = execute(w, cfg)
    write_exec(out / "measured", results)
    echo("measured:\n" + exec_table(results))
    vals = validate_folders(out / "predicted", out / "measured", list(cfg.policies))
    for v in vals:
        echo(format_validation(v))
    doc: object = vals
    if repeat > 1:                      # the same configuration again, policies in reverse order each time
        from cmoe.executor.run import run_policy
        from cmoe.validate import against_repeats, format_repeats
        runs = [vals]
        for k in range(2, repeat + 1):
            again = [run_policy(w, cfg, p) for p in reversed(cfg.policies)][::-1]
            write_exec(out / f"measured-{k}", again)
            runs.append(validate_folders(out / "predicted", out / f"measured-{k}", list(cfg.policies)))
        rows = against_repeats(runs)
        echo(f"against the mean of {repeat} measured runs (the machine's own noise is the spread):\n"
             + format_repeats(rows))
        doc = {"runs": runs, "against_mean": rows}
    write_text_atomic(out / "validation.json", json.dumps(doc, indent=1))
    echo(report_line([out / "predicted", out / "measured"], out / "report.html"))
    return vals


def predict(w, cfg, prof, out: Path) -> list:
    """Simulate exactly what the executor will run (its trace, expert format, bf16 non-expert
    weights, batch, pool and slots) under every policy of `cfg`, and write the run folder."""
    from cmoe.executor.run import budget_recipe
    from cmoe.quant import expert_bytes
    from cmoe.sim.api import write_outputs as write_sim
    from cmoe.sim.run import SimConfig, simulate
    rec = budget_recipe(w.fmt)
    t = replace(w.trace, recipe=rec, expert_bytes=expert_bytes(w.spec, rec))
    sims = [simulate(t, prof, SimConfig(policy=p, pool_gb=cfg.pool_gb, batch=cfg.batch, slots=cfg.slots))
            for p in cfg.policies]
    write_sim(out, t, prof, sims)
    return sims
