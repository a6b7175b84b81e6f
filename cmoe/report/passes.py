"""Per-pass figures both engines write next to their timelines (`passes-POLICY.json`): latency,
experts resident at the pass's end, and hits among the experts it ran. Plain data, no plotly."""

from __future__ import annotations

import json
from pathlib import Path

from cmoe.util import write_text_atomic


def pass_rows(pass_us: list, occupancy: list, pass_hits: list) -> list[dict]:
    return [{"pass": p, "decode": bool(d), "tokens": n, "us": us, "occupancy": occ, "hits": h, "experts": ran}
            for (p, d, n, us), occ, (h, ran) in zip(pass_us, occupancy, pass_hits)]


def write_passes(rows: list[dict], path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(rows))
