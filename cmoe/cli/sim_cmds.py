"""`cmoe simulate` and `cmoe sweep`: a trace through the simulator, once or over a grid of points."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe.cli.common import gigabytes, one_line_errors, positive
from cmoe.analysis.runfolder import MARKER as RUN_FOLDER

SWEEP_GRID = {"pool_gb": "12,16,20,24,28", "traces": "synthetic:mixtral-8x7b", "profiles": "h200", "batch": "1"}


@one_line_errors
def simulate(
    *,
    pool_gb: Annotated[float, typer.Option(parser=gigabytes, callback=positive, help="GPU memory for the model in GB (20, 20GB or 20G): resident weights, KV cache and the expert pool.")] = 20.0,
    trace: Annotated[str, typer.Option(help="A trace bundle folder, 'embedded' (the shipped trained model's trace), or synthetic:PRESET.")] = "synthetic:mixtral-8x7b",
    profile: Annotated[str, typer.Option(help="Hardware profile: h200, rtx4090 or a profile JSON file.")] = "h200",
    policy: Annotated[Optional[str], typer.Option(help="Comma-separated policies, or 'all' (default: all).")] = None,
    batch: Annotated[int, typer.Option(min=1, max=1024, help="Requests decoded together.")] = 1,
    quant: Annotated[Optional[str], typer.Option(help="Recompute expert sizes under this recipe (e.g. w4a16, mixed).")] = None,
    slots: Annotated[Optional[int], typer.Option(min=1, help="Pin the expert slots per block instead of deriving them from --pool-gb.")] = None,
    engine: Annotated[str, typer.Option(help="replay (compiled: the same spans and metrics as simpy, ~26x faster) or simpy (the SimPy model of record).")] = "replay",
    out: Annotated[Optional[Path], typer.Option(help="Folder for metrics.json, timelines (Parquet, Chrome trace) and policy JSON files.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder whole.")] = False,
    policies: Annotated[Optional[str], typer.Option("--policies", hidden=True)] = None,
) -> None:
    """Replay a trace through the simulator under each policy; print a row per policy (timelines only with --out)."""
    from cmoe.cli.common import every_policy, one_of, policy_names
    policies = one_of(policy, policies, "--policy", "--policies")
    from cmoe.sim.run import check_engine
    from cmoe.core.util import check_output
    if out:
        check_output(out, force, folder=True, marker=RUN_FOLDER)
    names = policy_names(policies)
    check_engine(engine)
    from cmoe.core.hw import load_profile
    from cmoe.sim.api import out_of_memory, run_policies, table, write_outputs
    from cmoe.trace.load import load_trace
    from cmoe.sim.priced import priceable
    prof = load_profile(profile)
    names, note = priceable(prof, names, every=every_policy(policies))
    if note:
        typer.echo(note, err=True)
    t = load_trace(trace, quant, batch)
    try:
        results = run_policies(t, prof, names, pool_gb, batch, slots, engine=engine, timeline=out is not None)
        if out:
            write_outputs(out, t, prof, results, force)
    except MemoryError:
        from cmoe.core.errors import CmoeError
        raise CmoeError(out_of_memory(t, len(names), out is not None)) from None
    typer.echo(f"{t.spec.name} ({t.recipe.name}), {prof.name}, pool {pool_gb:g} GB, batch {batch}, "
               f"{results[0].metrics['decode_tokens']} decode tokens")
    typer.echo(table(results))
    if out:
        from cmoe.report.build import report_line
        typer.echo(f"wrote {out}/metrics.json, timeline-*.parquet, timeline-*.json (Perfetto), policy-*.json")
        typer.echo(report_line([out]))


@one_line_errors
def sweep(
    *,
    pool_gb: Annotated[str, typer.Option(help="Comma-separated pool sizes in GB (20, 20GB or 20G each).")] = SWEEP_GRID["pool_gb"],
    trace: Annotated[Optional[str], typer.Option(help="Comma-separated trace bundles or synthetic:PRESET (default: " + SWEEP_GRID["traces"] + ").")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Comma-separated hardware profiles (default: " + SWEEP_GRID["profiles"] + ").")] = None,
    policy: Annotated[Optional[str], typer.Option(help="Comma-separated policies, or 'all' (default: all).")] = None,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = SWEEP_GRID["batch"],
    quant: Annotated[Optional[str], typer.Option(help="Recompute expert sizes under this recipe.")] = None,
    points: Annotated[Optional[Path], typer.Option(help="Instead of the grid: a YAML, JSON or CSV file of points, each giving any of trace, profile, quant, policy, pool_gb, batch, slots, include_prefill, groups, decode_steps, engine (grid options given one value fill what a point leaves out).")] = None,
    engine: Annotated[str, typer.Option(help="replay (compiled, the same metrics as simpy) or simpy.")] = "replay",
    jobs: Annotated[int, typer.Option(min=1, max=256, help="Parallel worker processes (with --ray auto and no cluster running: the CPUs of the local one it starts).")] = 2,
    ray: Annotated[Optional[str], typer.Option(help="Run the points on Ray: auto (the cluster this machine belongs to, else a new local one) or a cluster address.")] = None,
    resume: Annotated[bool, typer.Option(help="Keep the points --out already holds and run only the others.")] = False,
    retry_errors: Annotated[bool, typer.Option(help="With --resume, run again the points whose row has an error.")] = False,
    out: Annotated[Path, typer.Option(help="Parquet table, one row per point, rewritten as points finish.")] = Path("sweep.parquet"),
    force: Annotated[bool, typer.Option(help="Replace an existing --out table.")] = False,
    traces: Annotated[Optional[str], typer.Option("--traces", hidden=True)] = None,
    profiles: Annotated[Optional[str], typer.Option("--profiles", hidden=True)] = None,
    policies: Annotated[Optional[str], typer.Option("--policies", hidden=True)] = None,
) -> None:
    """Run a grid (or a file) of simulation points on local processes or Ray; stream one Parquet table, resumable."""
    from cmoe.cli.common import every_policy, names, numbers, one_of, policy_names
    traces = one_of(trace, traces, "--trace", "--traces")
    traces = SWEEP_GRID["traces"] if traces is None else traces
    profiles = one_of(profile, profiles, "--profile", "--profiles")
    profiles = SWEEP_GRID["profiles"] if profiles is None else profiles
    policies = one_of(policy, policies, "--policy", "--policies")
    from cmoe.core.errors import CmoeError
    from cmoe.sim.run import check_engine
    from cmoe.core.util import check_output
    if resume and force:
        raise CmoeError("--resume keeps the points in --out and --force replaces it: give one of them")
    check_output(out, force or resume)
    check_engine(engine)
    axes = {"trace": (names(traces, "--trace"), traces, "traces"), "profile": (names(profiles, "--profile"), profiles, "profiles"),
            "pool_gb": (numbers(pool_gb, "--pool-gb"), pool_gb, "pool_gb"), "policy": (policy_names(policies), policies, None),
            "batch": (numbers(batch, "--batch", integer=True), batch, "batch")}
    from cmoe.sweep import grid, points_file, sweep as run_sweep
    if points is not None:
        given = {k: v for k, (v, text, d) in axes.items() if text is not None and text != SWEEP_GRID.get(d)}
        pts = points_file(points, given, quant=quant, engine=engine)
    else:
        pts = grid(*(v for v, _, _ in axes.values()), quant, engine)
    if points is None and every_policy(policies):                           # every policy each profile prices
        pts = _priceable_points(pts)
    try:
        stats = run_sweep(pts, out, jobs=jobs, ray=ray, resume=resume, retry_errors=retry_errors)
    except KeyboardInterrupt:
        typer.echo(f"interrupted: the points that finished are in {out}; run the same command with --resume "
                   f"for the rest", err=True)
        raise typer.Exit(130) from None
    done = f", {stats.skipped} already there" if stats.skipped else ""
    bad = f" ({stats.failed} could not run; see the error column)" if stats.failed else ""
    typer.echo(f"wrote {out}: {stats.computed} points run{done}{bad}")
    from cmoe.report.build import report_line
    typer.echo(report_line([out]))


def _priceable_points(pts: list[dict]) -> list[dict]:
    """The grid's points less those whose profile cannot price their policy, each such profile named
    once (`cmoe.sim.priced.priceable`)."""
    from cmoe.core.hw import load_profile
    from cmoe.sim.priced import priceable
    keep = {}
    for pr in dict.fromkeys(p["profile"] for p in pts):
        kept, note = priceable(load_profile(pr), list(dict.fromkeys(p["policy"] for p in pts)), every=True)
        keep[pr] = set(kept)
        if note:
            typer.echo(note, err=True)
    return [p for p in pts if p["policy"] in keep[p["profile"]]]
