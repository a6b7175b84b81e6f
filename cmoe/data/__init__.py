"""Files cmoe ships: a small Mixtral-style MoE trained on CPython's standard library
(`tiny-moe/`, with its training log), a held-out sample of the same corpus, and a trace of the
model on held-out prompts (`trace-tiny-moe/`), the defaults of `cmoe trace`, `cmoe quality` and
`cmoe simulate`."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def default_model() -> Path:
    return HERE / "tiny-moe"


def default_heldout() -> Path:
    return HERE / "heldout.txt"


def default_prompts() -> Path:
    return HERE / "prompts.txt"


def default_trace() -> Path:
    return HERE / "trace-tiny-moe"
