"""The timeline schema, one for predicted (simulator) and measured (executor) runs. Floor 1.

Columns: source (sim or gpu), step (pass index), layer (decoder layer, -1 for none), stream
(compute, copy0.., cpu), op (attention, dense, shared, expert, load, cpu_expert, roundtrip),
expert (-1 for none), start_us, end_us, bytes. Spans are recorded as `Span`s (named tuples: read
by name, `s.op`, `s.end_us`) in a list and turned into a table once at the end. Parquet is written with pyarrow, which the GPU machine has,
so neither side needs polars to write a timeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class Span(NamedTuple):
    """One interval of one lane of a run's timeline (the simulator's or the executor's)."""
    source: str        # "sim", "gpu" or "cpu"
    step: int          # pass index
    layer: int         # decoder layer, -1 for none
    stream: str        # compute, copy0, ..., cpu, host
    op: str            # attention, expert, load, route, head, cpu_expert, roundtrip, host_* ...
    expert: int        # -1 for none
    start_us: float
    end_us: float
    bytes: int = 0


COLUMNS = Span._fields
# positions in a span, for readers of both engines' spans: the simulators record plain tuples
# in this order (a Span() costs ~0.6 us against ~0.05 us for a tuple, a large share of the
# replay's time per span), the executor records Spans; `s[OP]` reads either
SOURCE, STEP, LAYER, STREAM, OP, EXPERT, START, END, BYTES = range(9)


def arrow_table(spans: list[Span]):
    import pyarrow as pa
    cols = list(zip(*spans)) if spans else [[] for _ in COLUMNS]
    types = [pa.string(), pa.int32(), pa.int16(), pa.string(), pa.string(), pa.int16(),
             pa.float64(), pa.float64(), pa.int64()]
    return pa.table({c: pa.array(v, type=t) for c, v, t in zip(COLUMNS, cols, types)})


def write_parquet(spans: list[Span], path: str | Path) -> Path:
    import pyarrow.parquet as pq

    from cmoe.core.util import atomic_path
    with atomic_path(path) as tmp:
        pq.write_table(arrow_table(spans), tmp, compression="zstd")
    return Path(path)


def read_parquet(path: str | Path) -> list[Span]:
    import pyarrow.parquet as pq
    t = pq.read_table(path).to_pydict()
    return [Span(*r) for r in zip(*(t[c] for c in COLUMNS))]
