"""`cmoe trace` and `cmoe stats`: record, generate, import or export a trace, and its statistics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe.cli.common import one_line_errors


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
    depth: Annotated[int, typer.Option(min=1, max=4, help="Record predictions up to this many MoE layers ahead (pred_ahead; 1: the next layer only).")] = 4,
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
                             repetition=rep, pred_acc=pred_acc, seed=seed, ahead_ratio=SyntheticParams.ahead_ratio[: depth - 1])
    out = out or Path(f"trace-{synthetic or (model.name if model else 'tiny-moe')}")
    path = run_trace(out, model=model, data=data, synthetic=synthetic, quant=quant, params=params,
                     overwrite=force, parquet=parquet, max_new_tokens=32 if tokens is None else tokens,
                     max_prompt_tokens=max_prompt_tokens, record_logits=record_logits, device=device,
                     allow_pickle=allow_pickle, depth=depth)
    typer.echo(f"wrote {path}")


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
