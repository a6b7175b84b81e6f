"""Cut a trace into passes the engines replay: for each group of `batch` requests, one prefill pass
(every prompt token of the group) and then one decode pass per step (one token per request still
decoding). Per pass and MoE layer it gives the experts needed (union over the pass's tokens, most
voted first, ties in the first token's weight order) and the commit prediction, ordered the same way. numpy only; the
simulator and the executor replay the same passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmoe.errors import CmoeError
from cmoe.trace.bundle import DECODE, PREFILL, Trace


@dataclass(frozen=True)
class Pass:
    index: int
    decode: bool
    tokens: np.ndarray                       # [n] token indices into the trace
    needed: tuple[tuple[int, ...], ...]      # [M] experts routed, most voted first
    predicted: tuple[tuple[int, ...], ...]   # [M] commit prediction for layer m
    votes: tuple[tuple[int, ...], ...]       # [M] tokens routed to each needed expert
    context: int = 0                         # keys every token of the pass attends to, summed (position + 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


def ranked(rows: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token rows of expert ids -> experts by descending count (ties: first seen, i.e. by the
    first token's weight order) and their counts. Plain Python: passes are small."""
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
    decode passes: what `cmoe execute` replays is `groups=1, decode_steps=--tokens`."""
    if batch < 1:
        raise CmoeError(f"batch must be at least 1, got {batch}")
    reqs = np.unique(t.request)
    if reqs.size < batch:
        raise CmoeError(f"the trace has {reqs.size} requests but batch {batch} needs at least {batch}: "
                        f"trace more prompts or generate with --requests {batch}")
    M = t.spec.num_moe_layers
    experts, pred = t.experts.tolist(), t.pred_experts.tolist()       # [T][M][K]
    passes: list[Pass] = []
    starts = list(range(0, reqs.size - batch + 1, batch))[:groups]
    for g in starts:
        group = reqs[g:g + batch]
        in_group = np.isin(t.request, group)
        todo = []
        if include_prefill:
            pre = np.nonzero(in_group & (t.phase == PREFILL))[0]
            if pre.size:
                todo.append((False, pre))
        dec = np.nonzero(in_group & (t.phase == DECODE))[0]
        order = np.lexsort((t.request[dec], t.step[dec]))
        dec, steps = dec[order], t.step[dec[order]]
        for s in np.unique(steps)[:decode_steps]:
            todo.append((True, dec[steps == s]))
        for decode, idx in todo:
            rows = idx.tolist()
            need = [ranked([experts[i][m] for i in rows]) for m in range(M)]
            guess = [ranked([pred[i][m] for i in rows])[0] for m in range(M)]
            passes.append(Pass(len(passes), decode, idx, tuple(r[0] for r in need), tuple(guess),
                               tuple(r[1] for r in need), int(t.step[idx].astype(np.int64).sum()) + len(rows)))
    return passes


def has_predictions(t: Trace) -> bool:
    """Does the trace hold next-layer predictions (any decode token, any layer after the first,
    not -1)? Imported routing logs (vLLM, Megatron) have none."""
    dec = t.phase == DECODE
    return bool(t.num_tokens) and bool((t.pred_experts[dec][:, 1:] >= 0).any())


def check_predictions(t: Trace, policies) -> None:
    """Refuse, in one line, a policy that needs predictions on a trace that has none: it would
    otherwise run on empty predictions and report figures that mean nothing."""
    from cmoe.policy.policies import needs_predictions
    want = [p for p in policies if needs_predictions(p)]
    if want and not has_predictions(t):
        raise CmoeError(f"policy {want[0]} needs next-layer predictions but this trace has none (pred_experts "
                        f"are all -1): record one with cmoe trace, or choose ondemand, lfu-fallback, static or upper")


def popularity(t: Trace) -> list[list[int]]:
    """[M][E] how many tokens each expert served in the trace."""
    E = t.spec.num_experts
    return [np.bincount(t.experts[:, m].ravel().astype(np.int64), minlength=E).tolist()
            for m in range(t.spec.num_moe_layers)]
