"""Cut a trace into passes the engines replay: for each group of `batch` requests, one prefill pass
(every prompt token of the group) and then one decode pass per step (one token per request still
decoding). Per pass and MoE layer it gives the experts needed (union over the pass's tokens, most
voted first, ties in the first token's weight order) and the commit prediction, ordered the same way. numpy only; the
simulator and the executor replay the same passes.
"""

from __future__ import annotations

import numpy as np

from cmoe.core.errors import CmoeError
from cmoe.trace.bundle import DECODE, Trace
from cmoe.trace.pass_arrays import Pass, build, to_passes  # noqa: F401 (Pass: re-exported, most readers import it here)


def ranked(rows: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token rows of expert ids -> experts by descending count (ties: first seen, i.e. by the
    first token's weight order) and their counts."""
    counts: dict[int, int] = {}
    for row in rows:
        for e in row:
            if e >= 0:
                counts[e] = counts.get(e, 0) + 1
    order = sorted(counts, key=lambda e: -counts[e])
    return tuple(order), tuple(counts[e] for e in order)


def make_passes(t: Trace, batch: int, include_prefill: bool = True, groups: int | None = None,
                decode_steps: int | None = None) -> list[Pass]:
    """Every group of `batch` requests (or the first `groups`), each with at most `decode_steps`
    decode passes: what `cmoe execute` replays is `groups=1, decode_steps=--tokens`. Built for
    all passes at once (`cmoe.trace.pass_arrays`; each (pass, layer) ranked as `ranked` does)."""
    return to_passes(build(t, batch, include_prefill, groups, decode_steps))


def has_predictions(t: Trace) -> bool:
    """Does the trace hold next-layer predictions (any decode token, any layer after the first,
    not -1)? Imported routing logs (vLLM, Megatron) have none."""
    dec = t.phase == DECODE
    return bool(t.num_tokens) and bool((t.pred_experts[dec][:, 1:] >= 0).any())


def check_predictions(t: Trace, policies) -> None:
    """Refuse, in one line, a policy that needs predictions on a trace that has none, or deeper ones
    than the trace keeps: it would otherwise run on empty predictions and report figures that mean
    nothing under its name."""
    from cmoe.policy.policies import depth_of, needs_predictions
    want = [p for p in policies if needs_predictions(p)]
    if want and not has_predictions(t):
        raise CmoeError(f"policy {want[0]} needs next-layer predictions but this trace has none (pred_experts "
                        f"are all -1): record one with cmoe trace, or choose ondemand, lfu-fallback, static or upper")
    deep = [p for p in want if depth_of(p) > t.depth]
    if deep:                         # it would run, never prefetch, and still carry the look-ahead's name
        raise CmoeError(f"policy {deep[0]} looks {depth_of(deep[0])} layers ahead but this trace's predictions reach "
                        f"{t.depth}: record one with cmoe trace --depth {depth_of(deep[0])}, or choose adaptive or commit")


def popularity(t: Trace) -> list[list[int]]:
    """[M][E] how many tokens each expert served in the trace."""
    E = t.spec.num_experts
    return [np.bincount(t.experts[:, m].ravel().astype(np.int64), minlength=E).tolist()
            for m in range(t.spec.num_moe_layers)]
