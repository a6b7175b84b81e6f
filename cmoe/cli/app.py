"""The `cmoe` command line: thin commands, each calling one library function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe import __version__
from cmoe.cli.common import OneLineGroup, gigabytes, one_line_errors, positive
from cmoe.analysis.runfolder import MARKER as RUN_FOLDER

SWEEP_GRID = {"pool_gb": "12,16,20,24,28", "traces": "synthetic:mixtral-8x7b", "profiles": "h200", "batch": "1"}

app = typer.Typer(name="cmoe", no_args_is_help=True, add_completion=False, cls=OneLineGroup,
                  help="Trace, simulate and execute offloaded mixture-of-experts inference (CommitMoE and baselines).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cmoe {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                         help="Print the version and exit.")] = None) -> None:
    """cmoe: CommitMoE-style expert offloading, simulated and measured."""


@app.command()
@one_line_errors
def trace(
    *,
    model: Annotated[Optional[Path], typer.Option(help="Local Hugging Face checkpoint folder, safetensors (neither this nor --synthetic: the embedded trained model).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="Prompts: a .txt file (one per line) or .jsonl (prompt/text field); the embedded model has its own.")] = None,
    synthetic: Annotated[Optional[str], typer.Option(help="Generate a calibrated synthetic trace for this preset instead (e.g. mixtral-8x7b).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Bundle folder to write (default: trace-<name>).")] = None,
    quant: Annotated[str, typer.Option(help="Recipe for expert sizes: bf16, w4a16, w8a16, mixed, gptq-w4, a format like w4g128+w8g128:0.25, or 'checkpoint' (sizes as stored).")] = "w4a16",
    tokens: Annotated[Optional[int], typer.Option(min=0, help="Decode steps per request: greedy steps per prompt of a checkpoint (default: 32), or a synthetic trace's (default: 256).")] = None,
    max_prompt_tokens: Annotated[int, typer.Option(min=1, help="Truncate prompts to this many tokens.")] = 512,
    record_logits: Annotated[bool, typer.Option(help="Also store the full router logits [T, M, E].")] = False,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu.")] = "auto",
    allow_pickle: Annotated[bool, typer.Option(help="Allow pickle .bin weights (they can run code when loaded).")] = False,
    requests: Annotated[int, typer.Option(min=1, max=100_000, help="Synthetic: number of requests.")] = 4,
    skew: Annotated[float, typer.Option(min=0.0, help="Synthetic: Zipf exponent of expert popularity (0 = uniform).")] = 0.2,
    repetition: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Synthetic: first-expert repetition rate for every layer (default: Mixtral's Table 5 profile).")] = None,
    pred_acc: Annotated[float, typer.Option(min=0.0, max=1.0, help="Synthetic: share of true experts the commit prediction holds.")] = 0.85,
    seed: Annotated[int, typer.Option(min=0, help="Synthetic: random seed.")] = 0,
    parquet: Annotated[bool, typer.Option(help="Also write routes.parquet (one row per token and layer).")] = False,
    force: Annotated[bool, typer.Option(help="Replace an existing bundle.")] = False,
    import_log: Annotated[Optional[Path], typer.Option("--import", help="Turn a routing log into a bundle: vLLM/SGLang routed experts (.npy, .npz or a folder of .npy) or Megatron RouterTracer .jsonl; with --spec or --model.")] = None,
    spec: Annotated[Optional[str], typer.Option(help="--import: the preset the log came from (e.g. mixtral-8x7b).")] = None,
    prompt_tokens: Annotated[Optional[int], typer.Option(min=0, max=1_000_000, help="Prompt tokens per request: a synthetic trace's (default: 64), or with --import the first N tokens of each request (needed for vLLM logs) (default: 1 for Megatron).")] = None,
    export: Annotated[Optional[str], typer.Option(help="Write the routes of --trace in another system's format instead: vllm (one .npy per request, into --out).")] = None,
    trace_src: Annotated[Optional[str], typer.Option("--trace", help="--export: the bundle to export (a folder, embedded or synthetic:PRESET).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", min=0, hidden=True)] = None,
    decode_len: Annotated[Optional[int], typer.Option("--decode-len", min=1, max=1_000_000, hidden=True)] = None,
    prompt_len: Annotated[Optional[int], typer.Option("--prompt-len", min=1, max=1_000_000, hidden=True)] = None,
) -> None:
    """Record routing (and commit predictions) from a checkpoint, generate a synthetic trace, or
    import (export) another system's routing log."""
    from cmoe.cli.common import one_of
    from cmoe.trace.run import export_trace, import_trace, run_trace
    tokens = one_of(one_of(tokens, max_new_tokens, "--tokens", "--max-new-tokens"), decode_len, "--tokens", "--decode-len")
    prompt_tokens = one_of(prompt_tokens, prompt_len, "--prompt-tokens", "--prompt-len")
    if export is not None:
        if trace_src is None or out is None:
            from cmoe.core.errors import CmoeError
            raise CmoeError("--export needs --trace BUNDLE (what to export) and --out DIR (where)")
        files = export_trace(trace_src, export, out)
        typer.echo(f"wrote {len(files)} request files to {out}")
        return
    if import_log is not None:
        out = out or Path(f"trace-{import_log.stem}")
        typer.echo(f"wrote {import_trace(out, import_log, spec, model, quant, prompt_tokens, force, parquet)}")
        return
    from cmoe.trace.synthetic import MIXTRAL_REPETITION, SyntheticParams
    rep = ((0.0, repetition), (1.0, repetition)) if repetition is not None else MIXTRAL_REPETITION
    if synthetic and (prompt_tokens == 0 or (tokens or 0) > 1_000_000):
        from cmoe.core.errors import CmoeError
        raise CmoeError("a synthetic trace takes --prompt-tokens from 1 and --tokens up to 1000000")
    params = SyntheticParams(requests=requests, prompt_len=64 if prompt_tokens is None else prompt_tokens,
                             decode_len=256 if tokens is None else max(tokens, 1), skew=skew,
                             repetition=rep, pred_acc=pred_acc, seed=seed)
    name = synthetic or (model.name if model else "tiny-moe")
    out = out or Path(f"trace-{name}")
    path = run_trace(out, model=model, data=data, synthetic=synthetic, quant=quant, params=params,
                     overwrite=force, parquet=parquet, max_new_tokens=32 if tokens is None else tokens,
                     max_prompt_tokens=max_prompt_tokens, record_logits=record_logits, device=device,
                     allow_pickle=allow_pickle)
    typer.echo(f"wrote {path}")


@app.command()
@one_line_errors
def stats(
    bundle_dir: Annotated[str, typer.Argument(metavar="TRACE", help="A trace bundle folder, or 'embedded'.")],
    *,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the statistics as JSON here.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --json file.")] = False,
) -> None:
    """Statistics of a trace: load, entropy, repetition, reuse, prediction accuracy, bytes per token."""
    from dataclasses import asdict

    from cmoe.core.util import check_output
    if json_out:
        check_output(json_out, force, flag="--json")
    from cmoe.trace.load import load_trace
    from cmoe.trace.stats import format_table, layer_stats, summary
    t = load_trace(bundle_dir)
    typer.echo(format_table(t))
    if json_out:
        from cmoe.core.util import write_text_atomic
        layers = layer_stats(t)
        write_text_atomic(json_out, json.dumps({"summary": summary(t, layers),
                                                "layers": [asdict(x) for x in layers]}, indent=1))


@app.command()
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
    from cmoe.cli.common import one_of, policy_names
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
    prof = load_profile(profile)
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


@app.command()
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
    from cmoe.cli.common import names, numbers, one_of, policy_names
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


@app.command()
@one_line_errors
def execute(
    *,
    spec: Annotated[Optional[str], typer.Option(help="Random weights at this preset's exact shapes (e.g. mixtral-8x7b); needs --trace.")] = None,
    model: Annotated[Optional[Path], typer.Option(help="A local Hugging Face checkpoint folder (safetensors).")] = None,
    trace: Annotated[Optional[str], typer.Option(help="Replay routing from a trace bundle or synthetic:PRESET (with --model and no trace: live routing).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="Prompts for live routing, .txt or .jsonl (default: four built-in prompts).")] = None,
    policy: Annotated[str, typer.Option(help="Comma-separated policies, or 'all'.")] = "commit",
    policy_json: Annotated[Optional[Path], typer.Option(help="A policy file written by cmoe simulate --out; sets policy, pool and batch.")] = None,
    pool_gb: Annotated[float, typer.Option(parser=gigabytes, callback=positive, help="GPU memory for the model in GB (20, 20GB or 20G): resident weights, KV cache and the expert pool.")] = 20.0,
    batch: Annotated[int, typer.Option(min=1, max=1024, help="Requests decoded together.")] = 1,
    tokens: Annotated[int, typer.Option(min=1, help="Decode steps.")] = 256,
    quant: Annotated[Optional[str], typer.Option(help="Expert format: w4g128 (default), w4g32/64/256, bf16 or fp32.")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu.")] = "auto",
    seed: Annotated[int, typer.Option(min=0, help="Seed of random weights and of replayed token ids.")] = 0,
    slots: Annotated[Optional[int], typer.Option(min=1, help="Pin the expert slots per block instead of deriving them from --pool-gb.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder for metrics.json and the measured timeline-POLICY.parquet/.json.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder whole.")] = False,
    engine: Annotated[str, typer.Option(help="lean (CUDA graphs, static KV cache, one kernel launch per MoE layer) or hf (transformers' forward: the reference).")] = "lean",
) -> None:
    """Run offloaded decoding for real (GPU, or CPU for tests) and measure it."""
    from cmoe.cli.common import policy_names
    from cmoe.core.util import check_output
    if out:
        check_output(out, force, folder=True, marker=RUN_FOLDER)
    names = policy_names(policy, "--policy")
    from cmoe.executor.run import ExecConfig, execute as run_execute, prepare, table, write_outputs
    cfg = ExecConfig(policies=tuple(names), pool_gb=pool_gb, batch=batch, tokens=tokens, device=device,
                     quant=quant, seed=seed, slots=slots, progress=True, engine=engine)
    w, cfg = prepare(spec_name=spec, model_dir=model, trace_src=trace, data=data, cfg=cfg, policy_json=policy_json)
    results = run_execute(w, cfg)
    m = results[0].metrics
    typer.echo(f"{w.spec.name} ({w.fmt} experts), {m['device']}, pool {cfg.pool_gb:g} GB, batch {cfg.batch}, "
               f"{m['decode_tokens']} decode tokens, measured")
    typer.echo(table(results))
    cap = [r.metrics["capture_ms"] for r in results if r.metrics.get("capture_ms")]
    if cap:
        typer.echo(f"first decode pass: CUDA graphs warmed up and captured in {min(cap):.0f}-{max(cap):.0f} ms per "
                   f"policy (not counted in the passes' times)")
    if out:
        write_outputs(out, results, force)
        typer.echo(f"wrote {out}/metrics.json, timeline-*.parquet, timeline-*.json (Perfetto), passes-*.json")
        from cmoe.report.build import report_line
        typer.echo(report_line([out]))


@app.command()
@one_line_errors
def report(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="A run folder (simulate/execute --out), a sweep or timeline .parquet, or two run folders: predicted, then measured.")],
    *,
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default: report.html in the folder, X.html beside X.parquet, compare.html in the measured folder).")] = None,
    max_spans: Annotated[int, typer.Option(min=1, help="Most timeline spans drawn; whole passes from the first are kept.")] = 100_000,
    chrome: Annotated[Optional[Path], typer.Option(help="Instead: export a timeline .parquet as Chrome Trace Event JSON (Perfetto) to this file.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out or --chrome file.")] = False,
) -> None:
    """One self-contained HTML report (plotly.js embedded, works offline); or a Chrome trace export."""
    from cmoe.core.util import check_output
    for path, flag in ((out, "--out"), (chrome, "--chrome")):
        if path is not None:
            check_output(path, force, flag=flag)
    if chrome is not None:
        from cmoe.report.chrome import write_chrome_trace
        from cmoe.analysis.runfolder import read_timeline_file
        if len(inputs) != 1 or inputs[0].suffix != ".parquet":
            from cmoe.core.errors import CmoeError
            raise CmoeError("--chrome takes one timeline .parquet file (timeline-POLICY.parquet)")
        typer.echo(f"wrote {write_chrome_trace(read_timeline_file(inputs[0]), chrome)}")
        return
    from cmoe.report.build import build_report
    typer.echo(f"report: {build_report(inputs, out, max_spans)}")


@app.command()
@one_line_errors
def validate(
    predicted: Annotated[Path, typer.Argument(help="Folder written by cmoe simulate --out.")],
    measured: Annotated[list[Path], typer.Argument(help="Folder(s) written by cmoe execute --out (same trace, policy, pool, batch); several runs of one configuration also give the error against their mean and their spread.")],
    *,
    policy: Annotated[Optional[str], typer.Option(help="Comma-separated policies (default: every policy the measured run has).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="JSON file for the errors (default: MEASURED/validation.json).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out file (the default one is always rewritten).")] = False,
) -> None:
    """Predicted against measured: error per op kind, per layer, per token and end to end, and where it comes from."""
    from cmoe.core.util import check_output, write_text_atomic
    check_output(out or measured[0] / "validation.json", force or out is None)
    from cmoe.cli.common import policy_names
    from cmoe.analysis.validate import against_repeats, format_repeats, format_validation, validate_folders
    names = policy_names(policy, "--policy") if policy is not None else None
    runs = [validate_folders(predicted, m, names) for m in measured]
    for v in runs[0]:
        typer.echo(format_validation(v))
    doc: object = runs[0]
    if len(runs) > 1:
        rows = against_repeats(runs)
        typer.echo(f"against the mean of {len(runs)} measured runs:\n" + format_repeats(rows))
        doc = {"runs": runs, "against_mean": rows}
    path = write_text_atomic(out or measured[0] / "validation.json", json.dumps(doc, indent=1))
    typer.echo(f"wrote {path}")
    from cmoe.report.build import report_line
    typer.echo(report_line([predicted, measured[0]]))


@app.command()
@one_line_errors
def calibrate(
    *,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu. (cpu: a CPU profile, for tests and CPU runs)")] = "auto",
    spec: Annotated[str, typer.Option(help="Model shapes to measure experts and layers with (a preset).")] = "mixtral-8x7b",
    model: Annotated[Optional[Path], typer.Option(help="Or a local checkpoint: its shapes and its own layers.")] = None,
    quant: Annotated[str, typer.Option(help="Expert format the executor will run: w4g128, bf16, fp32, ...")] = "w4g128",
    layers: Annotated[int, typer.Option(help="Decoder layers of the preset to build for the per-layer measurement.")] = 4,
    name: Annotated[Optional[str], typer.Option(help="Profile name (default: the device's name).")] = None,
    out: Annotated[Path, typer.Option(help="Profile JSON to write (use it with --profile); the raw measurements go beside it.")] = Path("profile.json"),
    refit: Annotated[Optional[Path], typer.Option(help="Measure nothing: fit a profile to measurements written by an earlier calibrate.")] = None,
    strict: Annotated[bool, typer.Option(help="Refuse to write a profile when the repeats say the machine was noisy (wide spread, or copy/expert times that fall with size).")] = False,
) -> None:
    """Measure this machine for the simulator: copies, bandwidths, expert and layer times, CPU experts; write a profile."""
    from cmoe.core.util import write_text_atomic
    raw = refit
    if refit is not None:
        from cmoe.calibrate.profile_fit import refit_profile
        prof, m = refit_profile(refit, name)
    else:
        from cmoe.calibrate.measure import calibrate as measure_and_fit
        from cmoe.executor.run import resolve_device
        from cmoe.core.checkpoint import check_checkpoint
        from cmoe.core.spec import preset
        shapes = check_checkpoint(model, float_experts=True) if model else preset(spec)
        prof, m = measure_and_fit(resolve_device(device), shapes, quant, layers, model, name)
        raw = write_text_atomic(out.with_suffix(".measurements.json"), json.dumps(m, indent=1))
        typer.echo(f"wrote {raw}: the measurements (refit with --refit)")
    from cmoe.calibrate.profile_fit import beside, noise_of, verdict
    typer.echo(beside(prof, m))
    typer.echo(verdict(noise_of(m), strict, str(raw)))
    write_text_atomic(out, json.dumps(prof.to_dict(), indent=1))
    typer.echo(f"wrote {out}: use it with cmoe simulate --profile {out}")


@app.command(name="run")
@one_line_errors
def run_cmd(
    *,
    spec: Annotated[Optional[str], typer.Option(help="Random weights at this preset's shapes (with --trace, or its synthetic trace).")] = None,
    model: Annotated[Optional[Path], typer.Option(help="Or a local checkpoint, needs --trace (neither: the embedded trained model and its trace).")] = None,
    trace: Annotated[Optional[str], typer.Option(help="Trace to replay in both engines (with --spec and no trace: synthetic:SPEC).")] = None,
    policy: Annotated[str, typer.Option(help="Comma-separated policies, or 'all'.")] = "commit",
    pool_gb: Annotated[float, typer.Option(parser=gigabytes, callback=positive, help="GPU memory for the model in GB (20, 20GB or 20G).")] = 20.0,
    batch: Annotated[int, typer.Option(min=1, max=1024, help="Requests decoded together.")] = 1,
    tokens: Annotated[int, typer.Option(min=1, help="Decode steps executed.")] = 64,
    quant: Annotated[Optional[str], typer.Option(help="Expert format (default w4g128).")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu.")] = "auto",
    profile: Annotated[Optional[str], typer.Option(help="Use this profile instead of calibrating first.")] = None,
    slots: Annotated[Optional[int], typer.Option(min=1, help="Pin the expert slots per block (default for the embedded model: 4 of 8).")] = None,
    repeat: Annotated[int, typer.Option(min=1, max=100, help="Execute the policies this many times (measured-2/, ...): the error against their mean and their spread.")] = 1,
    out: Annotated[Path, typer.Option(help="Folder for profile, predicted/, measured/, validation.json, report.html.")] = Path("cmoe-run"),
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder whole.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also print the calibration table, both engines' tables and every policy's validation as they come.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout, nothing else.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (the results are in --out).")] = False,
) -> None:
    """Calibrate, simulate, execute and validate one configuration in one go; prints a summary."""
    import json
    import sys

    from cmoe.cli.common import policy_names
    from cmoe.pipeline import run_all
    names = policy_names(policy, "--policy")
    from cmoe.cli.common import device_name
    device = device_name(device)
    silent = quiet or json_out
    say = (lambda *_: None) if silent else typer.echo
    doc = run_all(out, spec_name=spec, model_dir=model, trace_src=trace, policies=tuple(names), pool_gb=pool_gb,
                  batch=batch, tokens=tokens, quant=quant, device=device, profile=profile, slots=slots, repeat=repeat,
                  echo=say, force=force, detail=typer.echo if verbose and not silent else (lambda *_: None),
                  progress=sys.stderr.isatty() and not silent)
    if json_out:
        typer.echo(json.dumps(doc, indent=1))


@app.command()
@one_line_errors
def quality(
    *,
    model: Annotated[Optional[Path], typer.Option(help="A local checkpoint (default: the embedded trained model).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="Held-out text to score, UTF-8 (default: the embedded held-out sample).")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="Positions to score.")] = 1024,
    window: Annotated[int, typer.Option(min=2, help="Score in windows of this many tokens, each from an empty cache (the embedded model was trained on 256).")] = 256,
    variants: Annotated[str, typer.Option(help="Comma-separated: commit, commit-no-owa.")] = "commit,commit-no-owa",
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Also write the table as JSON here.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out file.")] = False,
) -> None:
    """The quality cost of committing: KL, top-1 agreement and perplexity against exact routing; prediction accuracy per layer."""
    from cmoe.cli.common import names
    from cmoe.core.util import check_output
    if out:
        check_output(out, force)
    kinds = names(variants, "--variants")
    from cmoe.data import default_heldout, default_model
    from cmoe.quality.run import PUBLISHED, run_quality
    from cmoe.quality.measures import format_quality
    mdir = model or default_model()
    if data is not None and not data.is_file():
        from cmoe.core.errors import CmoeError
        raise CmoeError(f"{data} does not exist: pass --data a UTF-8 text file")
    text = (data or default_heldout()).read_bytes()
    from cmoe.cli.common import device_name
    res = run_quality(mdir, text, tokens, kinds, device_name(device), window)
    typer.echo(f"{mdir.name}: {res['tokens']} positions in windows of {res['window']}, teacher-forced, every expert resident")
    typer.echo(format_quality(res["rows"], res["pred_accuracy"], PUBLISHED))
    if out:
        from cmoe.core.util import write_text_atomic
        write_text_atomic(out, json.dumps(res, indent=1))


if __name__ == "__main__":
    app()
