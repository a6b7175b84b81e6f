"""The policies' decisions, compiled: a twin of each class of `cmoe.policy.policies` that makes
the same decisions over the same state, for a run of passes at a time. The Python classes stay the
model of record: `state.export` copies a policy object's state (its pool in LRU order, its
counters) into arrays, the twin advances it, `state.restore` writes it back, and
tests/test_replay.py checks the twins against the classes, decision for decision, on every policy.

Why compiled (numba) and not numpy: a policy's state after a layer decides the next layer, so the
work is a loop of a few dozen operations per (pass, layer) that cannot be vectorised; in CPython
even the classes' own bookkeeping costs 2.3-7.5 us per Mixtral layer (2026-12-01), more than the
whole replay may spend. numba is a wheel (no compiler at install), caches its machine code on
disk, and keeps the loop readable Python.

The state, the buffers and the pool mechanics are `twin_pool.py`'s.
"""

from __future__ import annotations

from numba import njit

from cmoe.sim.replay.twin_pool import (ADAPTIVE, ADAPTIVE_AHEAD, ADMIT, AFTER, AGREE, COMMIT, COMMIT_AHEAD,
                                       COMMIT_LOAD, DECODE, DEPTH, K, LFU, LRU_PREFETCH, OCC, ONDEMAND, ORACLE,
                                       PREFETCH, STATIC, TOP, UPPER, _among, _ensure, _exact, _gpu, _load, _mask,
                                       _place, _touch, _victim)


# the policies ------------------------------------------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _commit(s, d, m, predicted, protect, placed):
    n = min(predicted.size, s.nslots[m])
    chosen = predicted[:n]
    _mask(protect, chosen)
    _ensure(s, d, m, chosen, COMMIT_LOAD, protect, chosen[:0], placed, False)
    k = 0
    for i in range(n):                   # less what found no slot (commit-ahead's fetches, at batch > 1)
        if s.stamp[m, chosen[i]] >= 0:
            s.committed[m, k] = chosen[i]
            k += 1
    s.ncommitted[m] = k


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _reset(s):
    """Ahead._reset: a new pass, nothing wanted, fetched or named."""
    s.wanted[:] = False
    s.fresh[:] = False
    s.named[:] = 0


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _ran(s, m):
    s.wanted[m] = False
    s.fresh[m] = False
    s.named[m] = 0


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _prefetch(s, d, pd, p, q, k0, protect, placed):
    """Ahead._prefetch of `Pass.seen(q, depth)[k0:]`: layer q + k at distance k + 1, each top
    expert named once more, those named `agree` times wanted and fetched into the room left."""
    M, D = pd.M, pd.D
    for k in range(k0, min(s.ahd[DEPTH], D, M - q)):
        j = q + k
        r = (p * M + j) * D + k
        guess = pd.ahead[pd.ahead_ptr[r]:pd.ahead_ptr[r + 1]]
        guess = guess[:min(s.ahd[TOP], guess.size)]
        nw = 0
        for e in guess:
            s.named[j, e] += 1
            if s.named[j, e] >= s.ahd[AGREE]:
                s.keep[nw] = e
                nw += 1
                s.wanted[j, e] = True
        room = s.nslots[j] - 2 - s.fresh[j].sum()
        if room > 0:
            want = s.keep[:nw]
            _mask(protect, want)
            npl = _ensure(s, d, j, want[:min(room, nw)], PREFETCH, protect, want[:0], placed, False)
            for t in range(npl):
                s.fresh[j, placed[t]] = True


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _ahead(s, d, m, k, P, pd, protect, placed):
    if not 0 <= k < P:
        return
    i = k * pd.M + m
    need = pd.need[pd.need_ptr[i]:pd.need_ptr[i + 1]]
    s.scal[AFTER] = k
    _mask(protect, need)
    _ensure(s, d, m, need, PREFETCH, protect, need[:0], placed, False)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _begin(s, d, p, P, pd, protect, placed):
    decode = pd.decode[p]
    s.scal[DECODE] = decode
    if s.kind >= ADAPTIVE_AHEAD:
        _reset(s)
    if s.kind == COMMIT or s.kind == COMMIT_AHEAD:
        for m in range(pd.M):
            s.ncommitted[m] = -1
        if decode:
            _commit(s, d, 0, pd.pred[pd.pred_ptr[p * pd.M]:pd.pred_ptr[p * pd.M + 1]], protect, placed)
        if decode and s.kind == COMMIT_AHEAD:
            _prefetch(s, d, pd, p, 0, 1, protect, placed)
    elif s.kind == ADAPTIVE_AHEAD and decode:
        _prefetch(s, d, pd, p, 0, 0, protect, placed)
    elif s.kind == ORACLE:
        s.scal[K] += 1
        if s.scal[K]:
            _ahead(s, d, pd.M - 1, s.scal[K], P, pd, protect, placed)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _plan(s, d, p, m, P, pd, protect, hits, placed):
    M = pd.M
    i = p * M + m
    needed = pd.need[pd.need_ptr[i]:pd.need_ptr[i + 1]]
    kind = s.kind
    if kind == UPPER:
        for e in needed:
            _gpu(d, e, s.slot[m, e])
    elif kind == ONDEMAND:
        _exact(s, d, m, needed, protect, hits, placed)
    elif kind == LRU_PREFETCH:
        _exact(s, d, m, needed, protect, hits, placed)
        if m + 1 < M:
            nxt = pd.pred[pd.pred_ptr[i + 1]:pd.pred_ptr[i + 2]]
            guess = nxt[:min(nxt.size, s.nslots[m + 1])]
            _mask(protect, guess)
            _ensure(s, d, m + 1, guess, PREFETCH, protect, guess[:0], placed, False)
    elif kind == LFU:
        _lfu(s, d, m, needed, protect)
    elif kind == STATIC:
        for e in needed:
            if s.stamp[m, e] >= 0:
                _gpu(d, e, s.slot[m, e])
        for e in needed:
            if s.stamp[m, e] < 0:
                d.c_e[d.n[1]] = e
                d.n[1] += 1
    elif not s.scal[DECODE] and (kind == COMMIT or kind >= ADAPTIVE):   # prefill is exact
        _exact(s, d, m, needed, protect, hits, placed)
    elif kind == COMMIT or kind == COMMIT_AHEAD:
        _commit_layer(s, d, p, m, pd, needed, protect, placed)
    elif kind == ADAPTIVE or kind == ADAPTIVE_AHEAD:
        if kind == ADAPTIVE_AHEAD:
            _ran(s, m)
        nk = 0
        for j in range(needed.size):                        # the top-ranked, and the resident rest
            if j == 0 or s.stamp[m, needed[j]] >= 0:
                s.keep[nk] = needed[j]
                nk += 1
        _exact(s, d, m, s.keep[:nk], protect, hits, placed)
        d.skipped[d.n[3]] += needed.size - nk
        if kind == ADAPTIVE_AHEAD:
            _prefetch(s, d, pd, p, m + 1, 0, protect, placed)
    else:                                                   # oracle
        s.scal[AFTER] = s.scal[K]
        _exact(s, d, m, needed, protect, hits, placed)
        if m:
            _ahead(s, d, m - 1, s.scal[K] + 1, P, pd, protect, placed)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _commit_layer(s, d, p, m, pd, needed, protect, placed):
    """Commit.plan in decode (and CommitAhead's around it): the committed experts run, the next
    layer is committed, commit-ahead fetches further."""
    M = pd.M
    i = p * M + m
    ahead = s.kind == COMMIT_AHEAD
    if ahead:
        _ran(s, m)
        if m + 1 < M:
            for e in pd.pred[pd.pred_ptr[i + 1]:pd.pred_ptr[i + 2]]:
                s.wanted[m + 1, e] = True
    n = s.ncommitted[m]
    assert n >= 0, "a layer was never committed"
    chosen = s.committed[m, :n]
    for e in chosen:
        _touch(s, m, e)
    for e in chosen:
        _gpu(d, e, s.slot[m, e])
    for e in needed:
        if not _among(e, chosen):
            d.skipped[d.n[3]] += 1
    if m + 1 < M:
        _commit(s, d, m + 1, pd.pred[pd.pred_ptr[i + 1]:pd.pred_ptr[i + 2]], protect, placed)
    if ahead:
        _prefetch(s, d, pd, p, m + 1, 1, protect, placed)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _lfu(s, d, m, needed, protect):
    for e in needed:
        s.freq[m, e] += 1
    cpu, gpu = s.tmp1, s.tmp2
    nc = 0
    for e in needed:
        if s.stamp[m, e] >= 0:
            continue
        cpu[nc] = e
        nc += 1
    k = 0
    for e in needed:
        if s.stamp[m, e] >= 0:
            gpu[k] = e
            k += 1
    _mask(protect, needed)
    for e in cpu[:nc]:                                       # admitted in the background if hotter than the victim
        v = -1 if s.nfree[m] > 0 else _victim(s, m, protect)
        if s.nfree[m] > 0 or (v >= 0 and s.freq[m, v] < s.freq[m, e]):
            _load(d, m, e, _place(s, m, e, v), v, ADMIT)
    for e in gpu[:k]:
        _gpu(d, e, s.slot[m, e])
    for e in cpu[:nc]:
        d.c_e[d.n[1]] = e
        d.n[1] += 1


@njit(cache=True, _nrt=False)
def decide(s, d, pd, p0, p1, P):
    """Decisions for passes [p0, p1) of P: step (p - p0) * (M + 1) is pass p's begin_pass, the
    next M its layers' plans. `d` is filled from its start."""
    M = pd.M
    protect, hits, placed = s.protect, s.hits, s.placed
    for i in range(4):
        d.n[i] = 0
    for p in range(p0, p1):
        for step in range(M + 1):
            j = d.n[3]
            d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
            d.skipped[j] = 0
            if step == 0:
                _begin(s, d, p, P, pd, protect, placed)
            else:
                _plan(s, d, p, step - 1, P, pd, protect, hits, placed)
            d.n[3] = j + 1
        d.occupancy[p - p0] = s.scal[OCC]
    j = d.n[3]
    d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
