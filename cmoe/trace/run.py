"""`cmoe trace` as one library call: trace a checkpoint or generate a synthetic trace, then write
the bundle atomically."""

from __future__ import annotations

from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.trace import bundle
from cmoe.trace.synthetic import SyntheticParams, generate
from cmoe.core.util import check_output


def run_trace(out: Path, model: Path | None = None, data: Path | None = None, synthetic: str | None = None,
              quant: str = "w4a16", params: SyntheticParams = SyntheticParams(), overwrite: bool = False,
              parquet: bool = False, **trace_opts) -> Path:
    if model is not None and synthetic is not None:
        raise CmoeError("pass one of --model DIR (a local checkpoint) or --synthetic PRESET, not both")
    if model is None and synthetic is None:            # the embedded trained model and its held-out prompts
        from cmoe.data import default_model, default_prompts
        model, data = default_model(), data or default_prompts()
    check_output(out, overwrite, folder=True, marker=bundle.MARKER)
    if synthetic is not None:
        t = generate(preset(synthetic), recipe(quant), params)
    else:
        if data is None:
            raise CmoeError("tracing a checkpoint needs --data FILE (prompts, .txt or .jsonl)")
        _check_positions(model, trace_opts.get("max_new_tokens", 0))
        from cmoe.trace.hf import TraceOptions, trace_checkpoint
        t = trace_checkpoint(model, data, TraceOptions(quant=quant, **trace_opts))
    return bundle.write(t, out, overwrite=overwrite, parquet=parquet)


def _check_positions(model: Path, new_tokens: int) -> None:
    """Refuse decode steps that run past the model's positions (a prompt needs at least one)."""
    import json
    try:
        limit = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return                                        # the checkpoint's own checks say what is wrong
    if isinstance(limit, int) and new_tokens + 1 > limit:
        raise CmoeError(f"--tokens {new_tokens} runs past the model's max_position_embeddings ({limit}): "
                        f"give at most {limit - 1} (less the prompt's tokens)")


def import_trace(out: Path, log: Path, spec_name: str | None, model: Path | None, quant: str = "w4a16",
                 prompt_tokens: int | None = None, overwrite: bool = False, parquet: bool = False) -> Path:
    """A routing log from vLLM, SGLang or Megatron (`cmoe.trace.logs`) as a bundle, for the model
    named by a preset or a checkpoint's config.json."""
    from cmoe.core.spec import from_checkpoint
    from cmoe.trace.logs import import_log
    if (spec_name is None) == (model is None):
        raise CmoeError("--import needs the model the log came from: pass one of --spec PRESET or --model DIR")
    check_output(out, overwrite, folder=True, marker=bundle.MARKER)
    spec = preset(spec_name) if spec_name else from_checkpoint(model)
    t = import_log(Path(log), spec, recipe(quant), prompt_tokens)
    return bundle.write(t, out, overwrite=overwrite, parquet=parquet)


def export_trace(src: str, fmt: str, out: Path) -> list[Path]:
    """A bundle's routes in another system's format (`vllm`: one .npy per request)."""
    from cmoe.trace.load import load_trace
    from cmoe.trace.logs import export_vllm
    if fmt != "vllm":
        raise CmoeError(f"--export {fmt}: cmoe writes the vllm format (one .npy per request)")
    check_output(out, False, folder=True)
    return export_vllm(load_trace(src), out)
