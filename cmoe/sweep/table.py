"""The sweep's Parquet table, kept up to date while points finish: rows gather in memory and the
whole table is rewritten (under a temporary name, then renamed) every few seconds, so an
interrupted sweep leaves every finished point on disk and `--resume` skips them.

Columns: the point's settings (`cmoe.sweep.points.SETTINGS`), `point_id`, the metrics row of
`cmoe.sim.run.metrics`, `error` (one line, empty when the point ran), `traceback` (the full
text of an unexpected exception, else empty) and `wall_s` (the point's seconds on its worker).
Rows are in the order of the points given; rows of an earlier sweep that this one does not
name are kept, after them.
"""

from __future__ import annotations

import time
from pathlib import Path

from cmoe.core.errors import CmoeError

FLUSH_S = 2.0                    # at most this long between rewrites of the table


class SweepTable:
    def __init__(self, path: Path, order: list[str], resume: bool, retry_errors: bool = False):
        self.path, self.pos = path, {pid: i for i, pid in enumerate(order)}
        self.rows: dict[str, dict] = {}
        self.old: list[dict] = []                   # rows of an earlier sweep, not among these points
        self.last_flush, self.dirty = time.monotonic(), False
        if resume and path.exists():
            for r in _read(path):
                if retry_errors and r.get("error") and r["point_id"] in self.pos:
                    continue
                (self.rows.__setitem__(r["point_id"], r) if r["point_id"] in self.pos else self.old.append(r))
        self.had = len(self.rows) + len(self.old)   # rows the table held before this sweep

    def done(self) -> set[str]:
        return set(self.rows)

    def add(self, row: dict) -> None:
        self.rows[row["point_id"]] = row
        self.dirty = True
        if time.monotonic() - self.last_flush >= FLUSH_S:
            self.flush()

    def ok(self) -> bool:
        """Has any point, old or new, run without an error?"""
        return any(not r.get("error") for r in (*self.rows.values(), *self.old))

    def flush(self) -> None:
        """Rewrite the table whole, if anything changed and at least one point ran (a sweep all
        of whose points fail writes nothing)."""
        self.last_flush = time.monotonic()
        if not self.dirty or not self.ok():
            return
        import polars as pl

        from cmoe.core.util import atomic_path
        rows = sorted(self.rows.values(), key=lambda r: self.pos[r["point_id"]]) + self.old
        cols = list(dict.fromkeys(k for r in rows for k in r))
        tail = [c for c in ("error", "traceback", "wall_s") if c in cols]
        cols = [c for c in cols if c not in tail] + tail
        with atomic_path(self.path) as tmp:
            pl.DataFrame([{c: r.get(c) for c in cols} for r in rows], infer_schema_length=None).write_parquet(tmp)
        self.dirty = False


def _read(path: Path) -> list[dict]:
    import polars as pl
    try:
        df = pl.read_parquet(path)
    except Exception as e:                          # polars' and pyarrow's own errors
        raise CmoeError(f"{path} cannot be resumed: it is not a Parquet table ({str(e).splitlines()[0]}): "
                        f"choose another --out or drop --resume") from None
    if "point_id" not in df.columns or "error" not in df.columns:
        raise CmoeError(f"{path} cannot be resumed: it has no point_id column (not written by this cmoe sweep): "
                        f"choose another --out or pass --force instead of --resume")
    return df.to_dicts()
