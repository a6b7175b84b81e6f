"""Where a decode pass's time goes, and where the link's copies go, read off a timeline (either
engine's: the spans have one schema). Pure Python over spans; the report draws what this returns.

**Time breakdown** (`pass_breakdown`). A decode pass's window ends at its last span on the compute
stream and is as long as the pass's latency (`passes-POLICY.json`'s `us`, what TPOT averages), so
it also holds the wait before the pass's first span: both engines synchronise the device between
passes, copies included (queued decode passes, `pass_overlap`, do not: their window starts where
the last one ended, and a copy under way in it may be the next pass's). Without latencies it
starts at the pass's first span on any lane. The compute stream's busy time is split by op; its
idle time by what else was under way while it sat idle, in this order of blame:
- `idle: copy in flight`  a copy (`load`) of any pass was on a copy stream;
- `idle: CPU experts`     else a CPU expert or its hidden-state round trip was running;
- `idle: host`            else nothing the timeline shows: the host preparing, launching, reading back.
The five parts add up to the window exactly, so to the mean TPOT when latencies are given
(tests hold them to both). Only the compute stream's
idle time is blamed, so a copy that overlaps compute costs nothing here, which is the point.

**Copies per expert** (`expert_traffic`): per (MoE layer, expert) over the decode passes, how often
the expert ran (on the GPU or the CPU), how often it was copied in, and how often it ran on the CPU.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from cmoe.core.timeline import END, EXPERT, LAYER, OP, START, STEP, STREAM

PARTS = ("experts", "attention, router, head", "idle: copy in flight", "idle: CPU experts", "idle: host")
_CPU_OPS = ("cpu_expert", "roundtrip")


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _minus(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (disjoint, sorted) intervals `iv` outside the (disjoint, sorted) `cut`."""
    out, j = [], 0
    for a, b in iv:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, x = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > x:
                out.append((x, cut[k][0]))
            x = max(x, cut[k][1])
            k += 1
        if x < b:
            out.append((x, b))
    return out


class _Sorted:
    """Disjoint sorted intervals, cut to a window by bisection (a run's copies, read per pass)."""

    def __init__(self, iv: list[tuple[float, float]]):
        self.iv, self.starts, self.ends = iv, [a for a, _ in iv], [b for _, b in iv]

    def within(self, lo: float, hi: float) -> list[tuple[float, float]]:
        return self.iv[bisect_right(self.ends, lo): bisect_left(self.starts, hi)]


def _one_pass(spans: list, loads: _Sorted, cpu: _Sorted, us: float | None) -> dict[str, float]:
    """Microseconds of each part in one pass's window (`spans`: that pass's spans; `us`: its latency)."""
    comp = [s for s in spans if s[STREAM] == "compute"]
    if not comp:
        return {}
    hi = max(s[END] for s in comp)
    lo = hi - us if us is not None else min(s[START] for s in spans)
    busy_exp = _union([(s[START], s[END]) for s in comp if s[OP] == "expert"])
    busy_other = _minus(_union([(s[START], s[END]) for s in comp if s[OP] != "expert"]), busy_exp)
    idle = _minus([(lo, hi)], _union(busy_exp + busy_other))
    rest = _minus(idle, loads.within(lo, hi))                   # idle with no copy in flight
    host = _minus(rest, cpu.within(lo, hi))                     # ... and no CPU expert either
    return {PARTS[0]: _length(busy_exp), PARTS[1]: _length(busy_other), PARTS[2]: _length(idle) - _length(rest),
            PARTS[3]: _length(rest) - _length(host), PARTS[4]: _length(host)}


def pass_breakdown(spans: list, decode: set[int], latency: dict[int, float] | None = None) -> dict[str, float]:
    """Mean milliseconds per decode pass (`decode`: their indices) of each part of `PARTS`;
    `latency`: pass -> its latency in us (the window's length), if known."""
    loads = _Sorted(_union([(s[START], s[END]) for s in spans if s[OP] == "load"]))
    cpu = _Sorted(_union([(s[START], s[END]) for s in spans if s[OP] in _CPU_OPS]))
    by_pass: dict[int, list] = {}
    for s in spans:
        if s[STEP] in decode:
            by_pass.setdefault(s[STEP], []).append(s)
    tot = dict.fromkeys(PARTS, 0.0)
    n = 0
    for step, ps in by_pass.items():
        one = _one_pass(ps, loads, cpu, latency.get(step) if latency else None)
        n += bool(one)
        for part, v in one.items():
            tot[part] += v
    return {k: v / max(n, 1) / 1e3 for k, v in tot.items()}


def expert_traffic(spans: list, decode: set[int]) -> dict[tuple[int, int], dict[str, int]]:
    """(decoder layer, expert) -> {'runs', 'loads', 'cpu'} over the decode passes."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    for s in spans:
        if s[STEP] not in decode or s[EXPERT] < 0:
            continue
        key = "loads" if s[OP] == "load" else "cpu" if s[OP] == "cpu_expert" else "runs" if s[OP] == "expert" else None
        if key is None:
            continue
        c = out.setdefault((s[LAYER], s[EXPERT]), {"runs": 0, "loads": 0, "cpu": 0})
        c[key] += 1
        if key == "cpu":
            c["runs"] += 1
    return out

