"""Spans as the clock writes them (columns, chunk by chunk), turned at the end into the engine's
tuples in its canonical order (by start, end, stream; ties in the order they were recorded, as
Python's stable sort leaves them), and the slot log `record_log` asks for."""

from __future__ import annotations

import numpy as np

from cmoe.sim.replay.clock import OP_EXPERT, OP_LOAD, OPS, SPAN_DTYPES

BLOCK = 1 << 16                  # spans turned into tuples at a time
_FIELDS = ("sp_pass", "sp_layer", "sp_stream", "sp_op", "sp_expert", "sp_start", "sp_end", "sp_bytes", "sp_m", "sp_slot")


class Spans:
    def __init__(self, engines: int, keep: bool):
        self.names = ["compute", *(f"copy{i}" for i in range(engines)), "cpu"]       # stream codes
        self.keep = keep
        self.parts: list[list[np.ndarray]] = []

    def buffer(self, out, cap: int):
        """`out` with fresh span columns for `cap` spans (none when spans are not kept)."""
        cap = cap if self.keep else 0
        return out._replace(**{f: np.zeros(cap, t) for f, t in zip(_FIELDS, SPAN_DTYPES)})

    def keep_chunk(self, o, n: int) -> None:
        if self.keep and n:
            self.parts.append([getattr(o, f)[:n].copy() for f in _FIELDS])

    def tuples(self, with_log: bool) -> tuple[list[tuple], list[tuple]]:
        if not self.parts:
            return [], []
        cols = []
        for i in range(len(_FIELDS)):                  # one column at a time, each part let go once joined
            cols.append(np.concatenate([part[i] for part in self.parts]))
            for part in self.parts:
                part[i] = None
        self.parts = []
        log = _log(*(cols[i] for i in (3, 5, 6, 8, 9, 4))) if with_log else []
        cols[8] = cols[9] = None                          # slot and layer index: only the log reads them
        rank = np.argsort(np.argsort(np.array(self.names)))                         # string order of the codes
        order = np.lexsort((rank[cols[2]], cols[6], cols[5]))                       # stable, like list.sort
        for i in range(8):
            cols[i] = cols[i][order]                       # sorted, the unsorted column let go
        p, layer, stream, op, expert, start, end, nbytes = cols[:8]
        del cols
        names, ops = np.array(self.names, object), np.array(OPS, object)
        out: list[tuple] = []
        for lo in range(0, order.size, BLOCK):                                      # tuples a block at a time
            o = slice(lo, lo + BLOCK)
            out.extend(zip(["sim"] * (min(lo + BLOCK, order.size) - lo), p[o].tolist(), layer[o].tolist(),
                           names[stream[o]].tolist(), ops[op[o]].tolist(), expert[o].tolist(), start[o].tolist(),
                           end[o].tolist(), nbytes[o].tolist()))
        return out, log


def _log(op, start, end, m, slot, expert) -> list[tuple]:
    """(t, what, layer, slot, expert), two entries per load and per expert kernel, as recorded."""
    out = []
    for i in np.nonzero((op == OP_LOAD) | (op == OP_EXPERT))[0].tolist():
        a, b = ("load_start", "load_end") if op[i] == OP_LOAD else ("read_start", "read_end")
        out.append((float(start[i]), a, int(m[i]), int(slot[i]), int(expert[i])))
        out.append((float(end[i]), b, int(m[i]), int(slot[i]), int(expert[i])))
    return out
