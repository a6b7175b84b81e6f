"""`cmoe trace` as one library call: trace a checkpoint or generate a synthetic trace, then write
the bundle atomically."""

from __future__ import annotations

from pathlib import Path

from cmoe.errors import CmoeError
from cmoe.quant import recipe
from cmoe.spec import preset
from cmoe.trace import bundle
from cmoe.trace.synthetic import SyntheticParams, generate


def run_trace(out: Path, model: Path | None = None, data: Path | None = None, synthetic: str | None = None,
              quant: str = "w4a16", params: SyntheticParams = SyntheticParams(), overwrite: bool = False,
              parquet: bool = False, **trace_opts) -> Path:
    if model is not None and synthetic is not None:
        raise CmoeError("pass one of --model DIR (a local checkpoint) or --synthetic PRESET, not both")
    if model is None and synthetic is None:            # the embedded trained model and its held-out prompts
        from cmoe.data import default_model, default_prompts
        model, data = default_model(), data or default_prompts()
    if out.exists() and not overwrite:
        raise CmoeError(f"{out} already exists: choose another --out or pass --force to replace it")
    if synthetic is not None:
        t = generate(preset(synthetic), recipe(quant), params)
    else:
        if data is None:
            raise CmoeError("tracing a checkpoint needs --data FILE (prompts, .txt or .jsonl)")
        from cmoe.trace.hf import TraceOptions, trace_checkpoint
        t = trace_checkpoint(model, data, TraceOptions(quant=quant, **trace_opts))
    return bundle.write(t, out, overwrite=overwrite, parquet=parquet)
