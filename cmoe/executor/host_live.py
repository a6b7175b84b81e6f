"""A live decode pass's routes in the compiled host program (`cmoe.executor.host_program`): what
the Python step's `routes.Routes._parse_routes` makes of a layer's read-back when no trace is
replayed, made from the same pinned floats in machine code, into the arrays the policy's twin
reads (`cmoe.sim.replay.decide._plan`).

The read-back of layer m is N rows of C_m floats: the router's top-k ids, their weights, for
`commit` the router's logits, and for a policy that reads predictions the next layer's predicted
ids and weights (K2 each); `commit`'s layer-0 prediction comes back at the pass's start. Each row's
experts are ordered by weight, highest first, ties in column order (`routes._by_weight`, a stable
argsort); the layer's needs are the experts by how many rows chose them, ties by first sight
(`trace.passes.ranked`). The same for the prediction of layer m + 1, whose rows, ordered by
weight, are also commit's candidates for that layer (`host_commit._inputs` reads them).

A live run's passes are not known before they run, so the twin reads one pass's arrays (`live_pass`,
pass 0 of 1), filled layer by layer as the read-backs arrive: layer m's needs start where layer
m - 1's ended (`need_ptr[m]`), and layer m + 1's prediction where layer m's did (`pred_ptr[m + 1]`).
"""

from __future__ import annotations

import cmoe.sim.replay  # noqa: F401,E402  (first: it sets numba's cache folder, `cmoe.sim.replay`)

import numpy as np
from numba import njit

from cmoe.trace.pass_arrays import PassArrays

# Prog.lv columns: a layer's read-back floats per row, its prediction's columns (K2; 0: none) and
# where they start (after the ids, the weights and, for commit, the router's logits)
V_COLS, V_K2, V_PCOL = range(3)


def layout(cols: list[int], pred: list[int], N: int, K: int, E: int, commit: bool, rb0_cols: int,
           tp_shape: tuple) -> np.ndarray | None:
    """Prog.lv [M + 1, 3] for read-backs of `cols` floats a row per layer, whose next-layer
    prediction is `pred[m]` wide (0: none), as `lean_program._readback_parts` lays them out (ids K,
    weights K, commit's E logits, the prediction's ids and weights); row M: commit's layer-0
    prediction (ids, then weights, `rb0_cols` floats). None where a read-back is not that layout,
    or commit's candidate rows (tp [1, M, N, K2]) would not hold a prediction."""
    M = len(cols)
    pcol = 2 * K + (E if commit else 0)
    lv = np.zeros((M + 1, 3), np.int64)
    for m in range(M):
        if cols[m] != pcol + 2 * pred[m] or (commit and m + 1 < M and not pred[m]):
            return None
        lv[m] = cols[m], pred[m], pcol
    if commit:
        K2 = rb0_cols // 2
        if rb0_cols != 2 * K2 or tp_shape[2:] != (N, K2) or any(k not in (0, K2) for k in pred):
            return None
        lv[M] = rb0_cols, K2, 0
    return lv


def live_pass(M: int, E: int) -> PassArrays:
    """One decode pass's arrays with room for every expert of every layer, needs and predictions
    (the program writes them as its read-backs arrive; the other fields the twin does not read)."""
    z = np.zeros(1, np.int64)
    ptr = lambda: np.zeros(M + 1, np.int64)
    need_ptr, pred_ptr = ptr(), ptr()
    pred = np.zeros(M * E, np.int16)
    return PassArrays(decode=np.ones(1, bool), ntok=z, context=z, keys=z, tok_ptr=np.zeros(2, np.int64),
                      tok=np.zeros(0, np.int64), need_ptr=need_ptr, need=np.zeros(M * E, np.int16),
                      votes=np.zeros(M * E, np.int32), pred_ptr=pred_ptr, pred=pred, num_layers=M,
                      ahead_ptr=pred_ptr, ahead=pred, depth=1)


@njit(cache=True, _nrt=False)
def _order(v, at, K, order) -> None:
    """The K columns whose weights start at v[at], heaviest first, ties in column order (a stable
    insertion: `routes._by_weight`'s stable argsort), into order[:K]."""
    for c in range(K):
        w = v[at + c]
        j = c
        while j > 0 and v[at + order[j - 1]] < w:
            order[j] = order[j - 1]
            j -= 1
        order[j] = c


@njit(cache=True, _nrt=False)
def _ranked(v, N, C, K, c_id, c_w, E, scr, out) -> int:
    """`ranked(_by_weight(ids, w))` over the N rows of v (row i's floats at v[i * C:]; ids at
    columns c_id.., weights at c_w..): writes the experts into out, returns how many.
    scr: int64 scratch of 2E + K (counts, first-seen order, one row's column order). An id outside
    0..E-1 is no expert; a NaN weight (a broken router) sorts where numpy's argsort would not."""
    cnt, first, order = scr[:E], scr[E:2 * E], scr[2 * E:2 * E + K]
    cnt[:] = 0
    nf = 0
    for i in range(N):
        row = i * C
        _order(v, row + c_w, K, order)
        for r in range(K):
            e = int(v[row + c_id + order[r]])
            if e < 0 or e >= E:                            # no expert (a bad id is not counted either:
                continue                                   # numba checks no bounds)
            if cnt[e] == 0:
                first[nf] = e
                nf += 1
            cnt[e] += 1
    for a in range(nf):                                    # stable insertion by count, descending
        e = first[a]
        j = a
        while j > 0 and cnt[out[j - 1]] < cnt[e]:
            out[j] = out[j - 1]
            j -= 1
        out[j] = e
    return nf


@njit(cache=True, _nrt=False)
def _by_weight(v, N, C, K, c_id, c_w, rows, order) -> None:
    """Each row's ids by weight, highest first, ties in column order, into rows [N, >= K]
    (`routes._by_weight`, whose lists commit's candidates are drawn from); order: scratch of K."""
    for i in range(N):
        row = i * C
        _order(v, row + c_w, K, order)
        for r in range(K):
            rows[i, r] = int(v[row + c_id + order[r]])


@njit(cache=True, _nrt=False)
def live_begin(rbh, lv, N, E, scr, pd, tp, commit) -> None:
    """The live pass's start: with `commit`, layer 0's prediction (read back at the pass's start
    into rbh[M]: ids, then weights) ranked into the arrays and each row's into tp[0, 0]; else none."""
    M = pd.M
    pd.need_ptr[0] = 0
    pd.pred_ptr[0] = 0
    pd.pred_ptr[1] = 0
    if commit:
        K2 = lv[M, V_K2]
        pd.pred_ptr[1] = _ranked(rbh[M], N, lv[M, V_COLS], K2, 0, K2, E, scr, pd.pred[:E])
        _by_weight(rbh[M], N, lv[M, V_COLS], K2, 0, K2, tp[0, 0], scr[2 * E:])


@njit(cache=True, _nrt=False)
def live_routes(rbh, lv, N, E, K, scr, pd, tp, m, commit) -> None:
    """Layer m's needs, and with a prediction layer m + 1's (ranked, and commit's per row into
    tp[0, m + 1]), from its read-back rbh[m] into the live pass's arrays (`live_pass`)."""
    v, C, K2, pc = rbh[m], lv[m, V_COLS], lv[m, V_K2], lv[m, V_PCOL]
    a = pd.need_ptr[m]
    pd.need_ptr[m + 1] = a + _ranked(v, N, C, K, 0, K, E, scr, pd.need[a:a + E])
    if m + 2 < pd.pred_ptr.size:
        a = pd.pred_ptr[m + 1]
        n = _ranked(v, N, C, K2, pc, pc + K2, E, scr, pd.pred[a:a + E]) if K2 else 0
        pd.pred_ptr[m + 2] = a + n
        if commit:                                         # its candidates (`layout` checks tp's shape)
            _by_weight(v, N, C, K2, pc, pc + K2, tp[0, m + 1], scr[2 * E:])
