"""Reading a run folder: what `cmoe simulate --out` and `cmoe execute --out` write (metrics.json,
timeline-POLICY.parquet, passes-POLICY.json). Shared by reports and validation; pure I/O. Every
file is checked to be what it should be as it is read, so a wrong input is one line, not a
traceback further on."""

from __future__ import annotations

import json
from numbers import Real
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.timeline import COLUMNS, Span

MARKER = ("metrics.json",)       # a run folder always has it: --force replaces only such folders
PASS_FIELDS = ("pass", "decode", "tokens", "us")
_WRITTEN_BY = "give a folder written by cmoe simulate --out or cmoe execute --out"


def read_metrics(folder: Path, need: tuple[str, ...] = ()) -> list[dict]:
    """metrics.json: a list of per-policy dicts, each with a policy name and the keys in `need`."""
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CmoeError(f"{folder} has no readable metrics.json ({e}): {_WRITTEN_BY}") from None
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, dict) for m in metrics):
        raise CmoeError(f"{folder / 'metrics.json'} is not a list of per-policy metrics: {_WRITTEN_BY}")
    for m in metrics:
        pol = m.get("policy")
        if not isinstance(pol, str) or not pol or "/" in pol or "\\" in pol:
            raise CmoeError(f"{folder / 'metrics.json'} has an entry without a policy name: {_WRITTEN_BY}")
        missing = [k for k in need if k not in m]
        if missing:
            raise CmoeError(f"{folder / 'metrics.json'}: policy {pol} lacks {', '.join(missing)}: {_WRITTEN_BY}")
    return metrics


def _schema():
    from cmoe.core.timeline import arrow_table
    return arrow_table([]).schema


def read_timeline_file(path: Path) -> list[Span]:
    """A timeline Parquet file, checked to have the timeline's columns and types."""
    import pyarrow.parquet as pq
    try:
        schema = pq.read_schema(path)
    except Exception as e:                        # pyarrow raises several types for a bad file
        raise CmoeError(f"{path} is not a readable Parquet file ({type(e).__name__}): "
                        f"give a timeline written by cmoe simulate or execute") from None
    want = _schema()
    bad = [c for c in COLUMNS if c not in schema.names or schema.field(c).type != want.field(c).type]
    if bad:
        raise CmoeError(f"{path} is not a timeline: column {bad[0]} is missing or of another type "
                        f"(a timeline has {', '.join(COLUMNS)})")
    try:
        t = pq.read_table(path, columns=list(COLUMNS)).to_pydict()
    except Exception as e:
        raise CmoeError(f"{path} could not be read ({type(e).__name__}): write it again") from None
    return list(zip(*(t[c] for c in COLUMNS)))


def read_timeline(folder: Path, policy: str) -> list[Span]:
    tl = folder / f"timeline-{policy}.parquet"
    if not tl.is_file():
        raise CmoeError(f"{folder} lacks {tl.name}: was the run written completely?")
    return read_timeline_file(tl)


def read_passes(folder: Path, policy: str, required: bool) -> list[dict]:
    pj = folder / f"passes-{policy}.json"
    if not pj.is_file():
        if required:
            raise CmoeError(f"{folder} lacks {pj.name}: rerun with this cmoe, which writes it")
        return []
    try:
        rows = json.loads(pj.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CmoeError(f"{pj} is not readable JSON ({e}): {_WRITTEN_BY}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(isinstance(r.get(k), Real)
                                                                       for k in PASS_FIELDS) for r in rows):
        raise CmoeError(f"{pj} is not a list of passes with {', '.join(PASS_FIELDS)}: {_WRITTEN_BY}")
    return rows
