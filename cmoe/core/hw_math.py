"""The profile's arithmetic that is not a field's: the attention's split rule (shared with the
kernel, `kernels_triton.attention.splits`) and the measured tables' reading. Floor 1, no imports."""

from __future__ import annotations


def split_plan(cache_len: int, max_runs: int, block: int = 64) -> tuple[int, int]:
    """(runs, keys a run): how the lean engine's decode attention cuts a head's keys over a cache of
    `cache_len` slots, the kernel's own rule (`kernels_triton.attention.splits` calls this): runs
    of a multiple of `block` keys, at most `max_runs`; one run of the whole cache where one block
    covers it or the kernel does not split (max_runs 0 or 1)."""
    if max_runs <= 1 or cache_len <= block:
        return 1, cache_len
    per = -(-cache_len // max_runs)                 # ceil: keys a run must take
    ch = block * -(-per // block)                   # in whole blocks
    return -(-cache_len // ch), ch


def split_runs(cache_len: int, max_runs: int, block: int = 64) -> int:
    """The runs of `split_plan`: what the simulator prices (`HardwareProfile.attn_split_us`)."""
    return split_plan(cache_len, max_runs, block)[0]


def beside_copy(dur: float, extra: float, slow: float, launch: float) -> float:
    """`HardwareProfile.wave_beside_copy`'s arithmetic, which the compiled replay's clock runs too
    (`cmoe.sim.replay.compute` compiles this same function): a launch of `dur` us, `extra` of them
    not its experts' (commit's OWA), beside a moving copy. `launch` < 0 (not measured): the factor
    `slow` on the whole launch; else `slow` on the experts' own part plus `launch` us."""
    if launch < 0.0:
        return dur * slow
    return (dur - extra) * slow + extra + launch


def table_us(points: tuple, x: float) -> float:
    """A measured table read at x: piecewise-linear between points; the first value below them;
    past the last, the last piece extended when it rises and the last value when it falls (a
    falling cost flattens, it does not reach zero)."""
    if x <= points[0][0] or len(points) == 1:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + max(y1 - y0, 0.0) * (x - x1) / (x1 - x0)


def held(points: tuple, x: float, none: float) -> float:
    """A factor or extra table (`host_wake`, `cpu_wake_us`) read at x: `table_us` with x held at
    the last point (flat past it, where a cost table would extend); `none` where nothing was measured."""
    return table_us(points, min(x, points[-1][0])) if points else none


def _width(bits: float) -> str:
    return "int4" if bits <= 4 else "int8" if bits <= 8 else "bf16"


def pairs(v):
    """A table read from JSON (a list of [x, y] lists) as the profile holds it: a tuple of tuples;
    null as none (); anything else as it is (checked where the profile is made)."""
    if v is None:
        return ()
    return tuple(tuple(p) if isinstance(p, list) else p for p in v) if isinstance(v, (list, tuple)) else v
