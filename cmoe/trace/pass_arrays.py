"""The passes of `cmoe.trace.passes`, built for all passes at once with numpy and kept as flat
arrays (CSR: one pointer array per ragged field). The same rules, the same values:
`to_passes(build(...))` equals `make_passes(...)`, pass for pass; the fast replay reads the arrays
directly, so no per-pass Python objects are made. Legend: P passes, M MoE layers, K top-k,
E experts, N tokens over all passes, D distances of prediction (the trace's `depth`).

Ranking an (pass, layer)'s experts: by descending vote, ties by first appearance (tokens in pass
order, each token's experts in weight order), experts < 0 skipped. Passes of one token are
already ranked where every such row has distinct experts and no -1 (the usual case); the
others are sorted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cmoe.core.errors import CmoeError
from cmoe.trace.bundle import DECODE, PREFILL, Trace


@dataclass(frozen=True)
class Pass:
    """One pass (a prefill, or a decode step of a batch) as the SimPy model and the executor read it."""
    index: int
    decode: bool
    tokens: np.ndarray                       # [n] token indices into the trace
    needed: tuple[tuple[int, ...], ...]      # [M] experts routed, most voted first
    predicted: tuple[tuple[int, ...], ...]   # [M] commit prediction for layer m
    votes: tuple[tuple[int, ...], ...]       # [M] tokens routed to each needed expert
    context: int = 0                         # keys every token of the pass attends to, summed (position + 1)
    keys: int = 0                            # the longest row's keys (position + 1)
    ahead: tuple = ()                        # [M][D] prediction for layer m at distance k (index k-1); () = predicted only

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def seen(self, m: int, depth: int) -> list[list[int]]:
        """What the hidden state that predicts layer m (at distance 1) says of layers m..m+depth-1:
        the predictions a live run has once that state exists (m = 0: at the pass's start; m + 1:
        at layer m's plan). Shorter past the last layer or the trace's depth."""
        rows = self.ahead or tuple((p,) for p in self.predicted)
        D = len(rows[0]) if rows else 1
        return [list(rows[m + k][k]) for k in range(min(depth, D, len(rows) - m))]


@dataclass(frozen=True)
class PassArrays:
    decode: np.ndarray       # [P] bool
    ntok: np.ndarray         # [P] int64 tokens in the pass
    context: np.ndarray      # [P] int64 keys attended, summed (position + 1)
    keys: np.ndarray         # [P] int64 the longest row's keys (its position + 1): what a cache walk reads
    tok_ptr: np.ndarray      # [P+1] int64
    tok: np.ndarray          # [N] int64 token indices into the trace, pass by pass
    need_ptr: np.ndarray     # [P*M+1] int64
    need: np.ndarray         # int16 experts needed, ranked, per (pass, layer)
    votes: np.ndarray        # int32 tokens routed to each needed expert
    pred_ptr: np.ndarray     # [P*M+1] int64
    pred: np.ndarray         # int16 commit prediction, ranked the same way
    num_layers: int          # M
    ahead_ptr: np.ndarray    # [P*M*D+1] int64; (pass, layer m, distance k) at (p*M + m)*D + k-1
    ahead: np.ndarray        # int16 predictions by distance, ranked the same way (D = 1: pred itself)
    depth: int = 1           # D

    @property
    def num_passes(self) -> int:
        return int(self.decode.size)

    def seen(self, p: int, m: int, depth: int) -> list[list[int]]:
        """`Pass.seen` of pass p, from the arrays."""
        D, M, ptr = self.depth, self.num_layers, self.ahead_ptr
        out = []
        for k in range(min(depth, D, M - m)):
            i = (p * M + m + k) * D + k
            out.append(self.ahead[ptr[i]:ptr[i + 1]].tolist())
        return out

    def needed(self, p: int, m: int) -> np.ndarray:
        i = p * self.num_layers + m
        return self.need[self.need_ptr[i]:self.need_ptr[i + 1]]

    def future(self) -> list[tuple[tuple[int, ...], ...]]:
        """Per pass, per layer, the experts needed: what the oracle policy reads."""
        flat, ptr, M = self.need.tolist(), self.need_ptr.tolist(), self.num_layers
        return [tuple(tuple(flat[ptr[k]:ptr[k + 1]]) for k in range(p * M, p * M + M)) for p in range(self.num_passes)]


def _ranked(rows: np.ndarray, pass_of: np.ndarray, P: int, E: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [N, M, K] expert ids of the tokens in pass order, pass_of [N] -> (ptr [P*M+1], experts, votes)."""
    N, M, K = rows.shape
    single = np.bincount(pass_of, minlength=P)[pass_of] == 1                 # [N] alone in its pass
    one = rows[single]                                                         # [F, M, K]
    clean = (one >= 0).all()
    if K > 1 and clean:
        s = np.sort(one, axis=-1)
        clean = not (s[..., 1:] == s[..., :-1]).any()
    if clean:               # the usual case: single-token passes already ranked (experts distinct, none -1)
        f_pm = np.repeat((pass_of[single][:, None] * M + np.arange(M)).ravel(), K)
        f_e = one.reshape(-1).astype(np.int64)
        slow_rows, slow_pm = rows[~single], pass_of[~single][:, None] * M + np.arange(M)
    else:                   # rows of one token with repeats or -1 are ranked like the others
        f_pm = f_e = np.zeros(0, np.int64)
        slow_rows, slow_pm = rows, pass_of[:, None] * M + np.arange(M)
    s_pm = s_e = cnt = np.zeros(0, np.int64)
    if slow_rows.size:      # votes and first appearance per (pass, layer, expert), ranked within (pass, layer)
        se = slow_rows.reshape(-1, K).astype(np.int64)                         # [S*M, K], order kept
        keep = se >= 0
        key = (np.repeat(slow_pm.reshape(-1), keep.sum(1)) * E) + se[keep]
        ukey, first, cnt = np.unique(key, return_index=True, return_counts=True)
        order = np.lexsort((first, -cnt, ukey // E))
        s_pm, s_e, cnt = (ukey // E)[order], (ukey % E)[order], cnt[order].astype(np.int64)
    # merge: a (pass, layer) is all fast or all slow, each already in order; a stable sort by it
    all_pm = np.concatenate([f_pm, s_pm])
    order = np.argsort(all_pm, kind="stable")
    ptr = np.zeros(P * M + 1, np.int64)
    np.cumsum(np.bincount(all_pm, minlength=P * M), out=ptr[1:])
    return (ptr, np.concatenate([f_e, s_e])[order].astype(np.int16),
            np.concatenate([np.ones(f_e.size, np.int64), cnt])[order].astype(np.int32))


BLOCK_TOKENS = 4096          # tokens ranked at a time: the working arrays stay this size


def _ranked_blocks(routes: np.ndarray, tok: np.ndarray, tok_ptr: np.ndarray, pass_of: np.ndarray, P: int,
                   E: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_ranked` over whole passes of about BLOCK_TOKENS tokens at a time, joined (memory flat in
    trace length but for the compact result)."""
    M = routes.shape[1]
    ptrs, experts, votes = [np.zeros(1, np.int64)], [], []
    p0 = 0
    while p0 < P:
        p1 = max(p0 + 1, int(np.searchsorted(tok_ptr, tok_ptr[p0] + BLOCK_TOKENS, side="right")) - 1)
        p1 = min(p1, P)
        lo, hi = tok_ptr[p0], tok_ptr[p1]
        ptr, e, v = _ranked(routes[tok[lo:hi]], pass_of[lo:hi] - p0, p1 - p0, E)
        ptrs.append(ptr[1:] + (ptrs[-1][-1] if len(ptrs) > 1 else 0))
        experts.append(e)
        votes.append(v)
        p0 = p1
    if not experts:
        return np.zeros(P * M + 1, np.int64), np.zeros(0, np.int16), np.zeros(0, np.int32)
    return np.concatenate(ptrs), np.concatenate(experts), np.concatenate(votes)


def _pass_tokens(t: Trace, batch: int, include_prefill: bool, groups: int | None,
                 decode_steps: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tok [N] in pass order, pass_of [N], decode [P]) by make_passes' rules."""
    reqs = np.unique(t.request)
    if reqs.size < batch:
        raise CmoeError(f"the trace has {reqs.size} requests but batch {batch} needs at least {batch}: "
                        f"trace more prompts or generate with --requests {batch}")
    n_groups = len(list(range(0, reqs.size - batch + 1, batch))[:groups])
    gi = np.searchsorted(reqs, t.request).astype(np.int64) // batch        # [T] group of each token
    idx = np.arange(t.num_tokens, dtype=np.int64)
    pre = idx[(gi < n_groups) & (t.phase == PREFILL)] if include_prefill else idx[:0]
    pre = pre[np.argsort(gi[pre], kind="stable")]
    dec = idx[(gi < n_groups) & (t.phase == DECODE)]
    dec = dec[np.lexsort((t.request[dec], t.step[dec], gi[dec]))]
    g_dec, s_dec = gi[dec], t.step[dec].astype(np.int64)
    new_run = np.ones(dec.size, bool)
    new_run[1:] = (g_dec[1:] != g_dec[:-1]) | (s_dec[1:] != s_dec[:-1])
    run_id = np.cumsum(new_run) - 1                                        # [D] decode pass within all
    run_g = g_dec[new_run]
    first_run = np.searchsorted(run_g, np.arange(n_groups))                # first decode pass of each group
    rank = np.arange(run_g.size) - first_run[run_g] if run_g.size else run_g   # step rank within its group
    per_group = np.bincount(run_g, minlength=n_groups)
    kept = np.array([len(range(u)[:decode_steps]) for u in per_group.tolist()], np.int64)
    keep_run = rank < kept[run_g] if run_g.size else np.zeros(0, bool)
    dec, run_id = dec[keep_run[run_id]], run_id[keep_run[run_id]]
    # passes sorted by (group, prefill first, decode step rank)
    pre_g = np.unique(gi[pre]) if pre.size else np.zeros(0, np.int64)
    kept_runs = np.nonzero(keep_run)[0]
    key_g = np.concatenate([pre_g, run_g[kept_runs]])
    key_sub = np.concatenate([np.full(pre_g.size, -1), rank[kept_runs]])
    porder = np.lexsort((key_sub, key_g))                                   # pass slot -> source
    new_index = np.empty(porder.size, np.int64)
    new_index[porder] = np.arange(porder.size)
    pre_pass = new_index[np.searchsorted(pre_g, gi[pre])] if pre.size else np.zeros(0, np.int64)
    dec_pass = new_index[pre_g.size + np.searchsorted(kept_runs, run_id)] if dec.size else np.zeros(0, np.int64)
    toks = np.concatenate([pre, dec])
    pass_of = np.concatenate([pre_pass, dec_pass])
    o = np.argsort(pass_of, kind="stable")
    decode = np.concatenate([np.zeros(pre_g.size, bool), np.ones(kept_runs.size, bool)])[porder]
    return toks[o], pass_of[o], decode


def build(t: Trace, batch: int, include_prefill: bool = True, groups: int | None = None,
          decode_steps: int | None = None) -> PassArrays:
    """Every pass of `make_passes(t, batch, include_prefill, groups, decode_steps)`, as arrays."""
    if batch < 1:
        raise CmoeError(f"batch must be at least 1, got {batch}")
    tok, pass_of, decode = _pass_tokens(t, batch, include_prefill, groups, decode_steps)
    P, M, E = decode.size, t.spec.num_moe_layers, t.spec.num_experts
    E = max(E, int(t.experts.max(initial=0)) + 1, int(t.pred_experts.max(initial=0)) + 1)
    ntok = np.bincount(pass_of, minlength=P).astype(np.int64)
    tok_ptr = np.zeros(P + 1, np.int64)
    np.cumsum(ntok, out=tok_ptr[1:])
    context = np.zeros(P, np.int64)
    np.add.at(context, pass_of, t.step[tok].astype(np.int64))
    context += ntok
    keys = np.zeros(P, np.int64)
    np.maximum.at(keys, pass_of, t.step[tok].astype(np.int64) + 1)
    need_ptr, need, votes = _ranked_blocks(t.experts, tok, tok_ptr, pass_of, P, E)
    pred_ptr, pred, _ = _ranked_blocks(t.pred_experts, tok, tok_ptr, pass_of, P, E)
    D = t.depth
    ahead_ptr, ahead = pred_ptr, pred
    if D > 1:
        ahead_ptr, ahead, _ = _ranked_blocks(t.pred_ahead.reshape(t.num_tokens, M * D, -1), tok, tok_ptr, pass_of, P, E)
    return PassArrays(decode=decode, ntok=ntok, context=context, keys=keys, tok_ptr=tok_ptr, tok=tok, need_ptr=need_ptr,
                      need=need, votes=votes, pred_ptr=pred_ptr, pred=pred, num_layers=M, ahead_ptr=ahead_ptr,
                      ahead=ahead, depth=D)


def to_passes(pa: PassArrays) -> list:
    """The arrays as `cmoe.trace.passes.Pass` objects (what the SimPy model and the executor read)."""
    M = pa.num_layers
    need, votes, pred = pa.need.tolist(), pa.votes.tolist(), pa.pred.tolist()
    nptr, pptr = pa.need_ptr.tolist(), pa.pred_ptr.tolist()
    D, ahead, aptr = pa.depth, pa.ahead.tolist(), pa.ahead_ptr.tolist()
    out = []
    for p in range(pa.num_passes):
        lo = p * M
        needed = tuple(tuple(need[nptr[k]:nptr[k + 1]]) for k in range(lo, lo + M))
        v = tuple(tuple(votes[nptr[k]:nptr[k + 1]]) for k in range(lo, lo + M))
        guess = tuple(tuple(pred[pptr[k]:pptr[k + 1]]) for k in range(lo, lo + M))
        deep = () if D == 1 else tuple(tuple(tuple(ahead[aptr[i]:aptr[i + 1]]) for i in range(k * D, k * D + D))
                                       for k in range(lo, lo + M))
        out.append(Pass(p, bool(pa.decode[p]), pa.tok[pa.tok_ptr[p]:pa.tok_ptr[p + 1]], needed, guess, v,
                        int(pa.context[p]), int(pa.keys[p]), deep))
    return out


def csr(rows, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows as (pointer [len(rows) + 1] int64, values of `dtype`): row i is values[ptr[i]:ptr[i + 1]]."""
    ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=ptr[1:])
    return ptr, np.array([x for r in rows for x in r], dtype)


def from_passes(passes: list, num_layers: int) -> PassArrays:
    """`Pass` objects (made by hand, or by make_passes) as arrays."""
    M = num_layers
    ragged = lambda key, dtype: csr([row for ps in passes for row in getattr(ps, key)], dtype)  # noqa: E731
    assert all(len(ps.needed) == M for ps in passes), "a pass has the wrong number of layers"
    toks = [np.asarray(ps.tokens, np.int64) for ps in passes]
    ntok = np.array([t.size for t in toks], np.int64)
    D = len(passes[0].ahead[0]) if passes and passes[0].ahead else 1
    assert all(len(ps.ahead) == (M if D > 1 else 0) for ps in passes), "passes differ in their predictions' depth"
    aptr, ahead = csr([row for ps in passes for layer in (ps.ahead or [(p,) for p in ps.predicted]) for row in layer],
                      np.int16)
    (need_ptr, need), (_, votes), (pred_ptr, pred) = (ragged(k, t) for k, t in (("needed", np.int16), ("votes", np.int32),
                                                                                ("predicted", np.int16)))
    return PassArrays(ahead_ptr=aptr, ahead=ahead, depth=D,
                      decode=np.array([ps.decode for ps in passes], bool), ntok=ntok,
                      context=np.array([ps.context for ps in passes], np.int64),
                      keys=np.array([ps.keys for ps in passes], np.int64),
                      tok_ptr=np.concatenate([[0], np.cumsum(ntok)]).astype(np.int64),
                      tok=np.concatenate(toks) if toks else np.zeros(0, np.int64),
                      need_ptr=need_ptr, need=need, votes=votes, pred_ptr=pred_ptr, pred=pred, num_layers=M)


class Future(Sequence):
    """The passes' needed experts as the oracle policy reads them (`future[k][m]`), made on
    demand from the arrays; the compiled replay reads `arrays` directly."""

    def __init__(self, pa: PassArrays):
        self.arrays = pa

    def __len__(self) -> int:
        return self.arrays.num_passes

    def __getitem__(self, k: int) -> tuple[tuple[int, ...], ...]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        return tuple(tuple(self.arrays.needed(k, m).tolist()) for m in range(self.arrays.num_layers))
