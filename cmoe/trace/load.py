"""Where a trace comes from, for every consumer (simulator and executor alike): a bundle folder,
or `synthetic:PRESET`, generated on the spot with enough requests for the batch."""

from __future__ import annotations

from dataclasses import replace

from cmoe.core.quant import expert_bytes, recipe
from cmoe.core.spec import preset
from cmoe.trace import bundle
from cmoe.trace.bundle import Trace
from cmoe.trace.synthetic import SyntheticParams, generate

DEFAULT_TRACE = "synthetic:mixtral-8x7b"


def load_trace(source: str, quant: str | None = None, batch: int = 1) -> Trace:
    """A bundle folder, `embedded` (the trace of the trained model cmoe ships), or `synthetic:PRESET`
    (generated with enough requests for the batch)."""
    if source == "embedded":
        from cmoe.data import default_trace
        source = str(default_trace())
    if source.startswith("synthetic:"):
        rec = recipe(quant or "w4a16")
        return generate(preset(source.split(":", 1)[1]), rec, SyntheticParams(requests=max(4, batch)))
    t = bundle.read(source)
    if quant:
        rec = recipe(quant)
        t = replace(t, recipe=rec, expert_bytes=expert_bytes(t.spec, rec))
    return t
