"""Writing the per-pass figures both engines keep (`passes-POLICY.json`, rows from
`cmoe.core.metrics.RunRecord.pass_rows`): latency, experts resident at the pass's end, and hits among
the experts it ran. Plain data, no plotly."""

from __future__ import annotations

import json
from pathlib import Path

from cmoe.core.util import write_text_atomic


def write_passes(rows: list[dict], path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(rows))
