"""`cmoe execute`, `cmoe calibrate`, `cmoe run` and `cmoe quality`: what runs the model for real
(on a GPU, or the CPU for tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe.cli.common import gigabytes, one_line_errors, positive
from cmoe.analysis.runfolder import MARKER as RUN_FOLDER


def _spin(device: str, names, policy_json: Path | None, say) -> None:
    """OpenMP threads that spin for a run with CPU experts (or a calibration for one) on a GPU
    (`cmoe.executor.omp_wait`), set before anything loads torch; said where cmoe set it or could not."""
    from cmoe.executor.omp_wait import for_policies
    if policy_json is not None:                 # the file's policy decides; an unreadable file is refused later
        try:
            names = (str(json.loads(policy_json.read_text()).get("policy")),)
        except (OSError, ValueError, AttributeError):
            names = ()
    if (said := for_policies(device, names)) is not None:
        say(said)


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
    quant: Annotated[Optional[str], typer.Option(help="Expert format: w4g128 (default), w4g32/64/256, bf16 or fp32; a GPTQ or AWQ checkpoint's experts run as stored (w4gG-fp16: fp16 scale and zero-point pairs), so leave it out there.")] = None,
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
    _spin(device, names, policy_json, typer.echo)
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


@one_line_errors
def calibrate(
    *,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu. (cpu: a CPU profile, for tests and CPU runs)")] = "auto",
    spec: Annotated[str, typer.Option(help="Model shapes to measure experts and layers with (a preset).")] = "mixtral-8x7b",
    model: Annotated[Optional[Path], typer.Option(help="Or a local checkpoint: its shapes and its own layers.")] = None,
    quant: Annotated[str, typer.Option(help="Expert format the executor will run: w4g128, w4g32/64/256, w4gG-fp16 (GPTQ/AWQ pairs), bf16, fp32.")] = "w4g128",
    layers: Annotated[int, typer.Option(help="Decoder layers of the preset to build for the per-layer measurement.")] = 4,
    name: Annotated[Optional[str], typer.Option(help="Profile name (default: the device's name).")] = None,
    out: Annotated[Path, typer.Option(help="Profile JSON to write (use it with --profile); the raw measurements go beside it.")] = Path("profile.json"),
    refit: Annotated[Optional[Path], typer.Option(help="Measure nothing: fit a profile to measurements written by an earlier calibrate.")] = None,
    strict: Annotated[bool, typer.Option(help="Refuse to write a profile when the repeats say the machine was noisy (wide spread, or copy/expert times that fall with size).")] = False,
    policy: Annotated[str, typer.Option(help="The policies the profile will serve, comma-separated, or 'all'. Where none runs CPU experts, OpenMP's threads sleep on a GPU as those runs' do, the CPU experts' repeats are shown, not judged, and none runs inside the model, so the profile cannot price lfu-fallback or static.")] = "all",
) -> None:
    """Measure this machine for the simulator: copies, bandwidths, expert and layer times, CPU experts; write a profile."""
    from cmoe.cli.common import policy_names
    from cmoe.core.util import write_text_atomic
    from cmoe.policy.policies import any_trait
    names = policy_names(policy, "--policy")
    cpu = any_trait(names, "cpu_experts")      # the profile may serve a CPU-expert policy
    raw = refit
    if refit is not None:
        from cmoe.calibrate.profile_fit import refit_profile
        prof, m = refit_profile(refit, name)
    else:
        _spin(device, names, None, typer.echo)    # a team spinning on every core slows GPU-only runs' host
        from cmoe.calibrate.measure import calibrate as measure_and_fit
        from cmoe.executor.run import resolve_device
        from cmoe.core.checkpoint import check_checkpoint
        from cmoe.core.spec import preset
        shapes = check_checkpoint(model, float_experts=True) if model else preset(spec)
        prof, m = measure_and_fit(resolve_device(device), shapes, quant, layers, model, name,
                                  cpu_experts=cpu)
        raw = write_text_atomic(out.with_suffix(".measurements.json"), json.dumps(m, indent=1))
        typer.echo(f"wrote {raw}: the measurements (refit with --refit)")
    from cmoe.calibrate.beside import beside
    from cmoe.calibrate.profile_fit import noise_of, verdict
    typer.echo(beside(prof, m))
    typer.echo(verdict(noise_of(m, cpu), strict, str(raw)))
    write_text_atomic(out, json.dumps(prof.to_dict(), indent=1))
    typer.echo(f"wrote {out}: use it with cmoe simulate --profile {out}")


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
    quant: Annotated[Optional[str], typer.Option(help="Expert format (default w4g128; w4gG-fp16 for GPTQ/AWQ pairs).")] = None,
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
    silent = quiet or json_out
    say = (lambda *_: None) if silent else typer.echo
    _spin(device, names, None, say)      # its calibration's CPU experts serve CPU-expert policies only
    from cmoe.cli.common import device_name
    device = device_name(device)
    doc = run_all(out, spec_name=spec, model_dir=model, trace_src=trace, policies=tuple(names), pool_gb=pool_gb,
                  batch=batch, tokens=tokens, quant=quant, device=device, profile=profile, slots=slots, repeat=repeat,
                  echo=say, force=force, detail=typer.echo if verbose and not silent else (lambda *_: None),
                  progress=sys.stderr.isatty() and not silent)
    if json_out:
        typer.echo(json.dumps(doc, indent=1))


@one_line_errors
def quality(
    *,
    model: Annotated[Optional[Path], typer.Option(help="A local checkpoint (default: the embedded trained model).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="Held-out text to score, UTF-8 (default: the embedded held-out sample).")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="Positions to score.")] = 1024,
    window: Annotated[int, typer.Option(min=2, help="Score in windows of this many tokens, each from an empty cache (the embedded model was trained on 256).")] = 256,
    variants: Annotated[str, typer.Option(help="Comma-separated: commit, commit-no-owa (every expert resident), adaptive, adaptive-ahead, commit-ahead (half of each layer's experts in the pool).")] = "commit,commit-no-owa,adaptive",
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
