"""The `cmoe` command line: thin commands, each calling one library function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cmoe import __version__
from cmoe.cli.common import one_line_errors

app = typer.Typer(name="cmoe", no_args_is_help=True, add_completion=False,
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
    model: Annotated[Optional[Path], typer.Option(help="Local Hugging Face checkpoint folder (safetensors).")] = None,
    data: Annotated[Optional[Path], typer.Option(help="Prompts: a .txt file (one per line) or .jsonl (prompt/text field).")] = None,
    synthetic: Annotated[Optional[str], typer.Option(help="Generate a calibrated synthetic trace for this preset instead (e.g. mixtral-8x7b).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Bundle folder to write [default: trace-<name>].")] = None,
    quant: Annotated[str, typer.Option(help="Recipe for expert sizes: bf16, w4a16, w8a16, mixed, gptq-w4, a format like w4g128+w8g128:0.25, or 'checkpoint' (sizes as stored).")] = "w4a16",
    max_new_tokens: Annotated[int, typer.Option(help="Greedy decode steps per prompt (checkpoint tracing).")] = 32,
    max_prompt_tokens: Annotated[int, typer.Option(help="Truncate prompts to this many tokens.")] = 512,
    record_logits: Annotated[bool, typer.Option(help="Also store the full router logits [T, M, E].")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    allow_pickle: Annotated[bool, typer.Option(help="Allow pickle .bin weights (they can run code when loaded).")] = False,
    requests: Annotated[int, typer.Option(help="Synthetic: number of requests.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Synthetic: prefill tokens per request.")] = 64,
    decode_len: Annotated[int, typer.Option(help="Synthetic: decode tokens per request.")] = 256,
    skew: Annotated[float, typer.Option(help="Synthetic: Zipf exponent of expert popularity (0 = uniform).")] = 0.2,
    repetition: Annotated[Optional[float], typer.Option(help="Synthetic: first-expert repetition rate for every layer [default: Mixtral's Table 5 profile].")] = None,
    pred_acc: Annotated[float, typer.Option(help="Synthetic: share of true experts the commit prediction holds.")] = 0.85,
    seed: Annotated[int, typer.Option(help="Synthetic: random seed.")] = 0,
    parquet: Annotated[bool, typer.Option(help="Also write routes.parquet (one row per token and layer).")] = False,
    force: Annotated[bool, typer.Option(help="Replace an existing bundle.")] = False,
) -> None:
    """Record routing (and commit predictions) from a checkpoint, or generate a synthetic trace."""
    from cmoe.trace.run import run_trace
    from cmoe.trace.synthetic import MIXTRAL_REPETITION, SyntheticParams
    rep = ((0.0, repetition), (1.0, repetition)) if repetition is not None else MIXTRAL_REPETITION
    params = SyntheticParams(requests=requests, prompt_len=prompt_len, decode_len=decode_len, skew=skew,
                             repetition=rep, pred_acc=pred_acc, seed=seed)
    name = synthetic or (model.name if model else "none")
    out = out or Path(f"trace-{name}")
    path = run_trace(out, model=model, data=data, synthetic=synthetic, quant=quant, params=params,
                     overwrite=force, parquet=parquet, max_new_tokens=max_new_tokens,
                     max_prompt_tokens=max_prompt_tokens, record_logits=record_logits, device=device,
                     allow_pickle=allow_pickle)
    typer.echo(f"wrote {path}")


@app.command()
@one_line_errors
def stats(
    bundle_dir: Annotated[Path, typer.Argument(metavar="TRACE", help="A trace bundle folder.")],
    *,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the statistics as JSON here.")] = None,
) -> None:
    """Statistics of a trace: load, entropy, repetition, reuse, prediction accuracy, bytes per token."""
    from dataclasses import asdict

    from cmoe.trace import bundle
    from cmoe.trace.stats import format_table, layer_stats, summary
    t = bundle.read(bundle_dir)
    typer.echo(format_table(t))
    if json_out:
        from cmoe.util import write_text_atomic
        layers = layer_stats(t)
        write_text_atomic(json_out, json.dumps({"summary": summary(t, layers),
                                                "layers": [asdict(x) for x in layers]}, indent=1))


if __name__ == "__main__":
    app()
