"""Reading a run folder: what `cmoe simulate --out` and `cmoe execute --out` write (metrics.json,
timeline-POLICY.parquet, passes-POLICY.json). Shared by reports and validation; pure I/O."""

from __future__ import annotations

import json
from pathlib import Path

from cmoe.errors import CmoeError
from cmoe.timeline import Span, read_parquet


def read_metrics(folder: Path) -> list[dict]:
    try:
        return json.loads((folder / "metrics.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CmoeError(f"{folder} has no readable metrics.json ({e}): give a folder written by "
                        f"cmoe simulate --out or cmoe execute --out") from None


def read_timeline(folder: Path, policy: str) -> list[Span]:
    tl = folder / f"timeline-{policy}.parquet"
    if not tl.is_file():
        raise CmoeError(f"{folder} lacks {tl.name}: was the run written completely?")
    return read_parquet(tl)


def read_passes(folder: Path, policy: str, required: bool) -> list[dict]:
    pj = folder / f"passes-{policy}.json"
    if not pj.is_file():
        if required:
            raise CmoeError(f"{folder} lacks {pj.name}: rerun with this cmoe, which writes it")
        return []
    return json.loads(pj.read_text())
