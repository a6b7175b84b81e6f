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

Pool state per block m (legend: M blocks, E experts, S most slots of a block): `stamp[m, e]` the
expert's place in LRU order (larger = more recent; -1 not resident, the OrderedDict's order),
`slot[m, e]`, and the free slots `free[m, :nfree[m]]` (popped from the end, as the list is).
A decision run writes, per step (a pass's `begin_pass`, then each layer's `plan`), the GPU experts
and their slots, the CPU experts, the loads and the skipped count (`Decisions`, CSR).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

UPPER, ONDEMAND, LRU_PREFETCH, LFU, STATIC, COMMIT, ORACLE, ADAPTIVE = range(8)
KIND_OF = {"upper": UPPER, "ondemand": ONDEMAND, "lru-prefetch": LRU_PREFETCH, "lfu-fallback": LFU,
           "static": STATIC, "commit": COMMIT, "oracle": ORACLE, "adaptive": ADAPTIVE}
LOAD_KINDS = ("demand", "commit", "prefetch", "admit")      # code = the SimPy model's priority rank
DEMAND, COMMIT_LOAD, PREFETCH, ADMIT = range(4)
NEVER = np.int64(1) << 62                                    # next use of an expert never used again
CLOCK, DECODE, K, AFTER, OCC = range(5)                      # PolicyState.scal (OCC: experts resident)

PolicyState = namedtuple("PolicyState", [
    "kind", "nslots", "stamp", "slot", "free", "nfree", "freq", "scal",
    "committed", "ncommitted",        # commit: [M, E] chosen experts, [M] how many (-1: none)
    "uptr", "uses",                   # oracle: CSR over (m, e) of the passes that need e in block m
    "protect", "hits", "placed", "tmp1", "tmp2", "keep",   # scratch, [E] each (compiled code allocates nothing)
])
Decisions = namedtuple("Decisions", [
    "n",                              # [4] counts written: gpu, cpu, loads, steps
    "g_ptr", "g_e", "g_slot",         # per step: GPU experts in order and the slot each is read from
    "c_ptr", "c_e",                   # CPU experts
    "l_ptr", "l_layer", "l_e", "l_slot", "l_victim", "l_kind",   # loads in issue order (victim -1: a free slot)
    "skipped", "occupancy",           # per step; per pass: experts resident at its end
])
PassData = namedtuple("PassData", ["decode", "need_ptr", "need", "votes", "pred_ptr", "pred", "M"])


def decisions(steps: int, passes: int, E: int) -> Decisions:
    """Buffers for `steps` steps: a step's GPU and CPU experts are at most E each, its loads 2E."""
    z = lambda n: np.zeros(n, np.int64)
    return Decisions(z(4), z(steps + 1), z(steps * E), z(steps * E), z(steps + 1), z(steps * E),
                     z(steps + 1), z(2 * steps * E), z(2 * steps * E), z(2 * steps * E), z(2 * steps * E),
                     z(2 * steps * E), z(steps), z(passes))


# pool mechanics ----------------------------------------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _touch(s, m, e):
    s.scal[CLOCK] += 1
    s.stamp[m, e] = s.scal[CLOCK]


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _place(s, m, e, v):
    if v < 0:
        s.nfree[m] -= 1
        s.scal[OCC] += 1
        slot = s.free[m, s.nfree[m]]
    else:
        slot = s.slot[m, v]
        s.stamp[m, v] = -1
    s.scal[CLOCK] += 1
    s.stamp[m, e] = s.scal[CLOCK]
    s.slot[m, e] = slot
    return slot


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _next_use(s, m, e):
    i = m * s.stamp.shape[1] + e
    lo, hi = s.uptr[i], s.uptr[i + 1]
    after = s.scal[AFTER]
    while lo < hi:                                     # bisect_right
        mid = (lo + hi) >> 1
        if s.uses[mid] <= after:
            lo = mid + 1
        else:
            hi = mid
    return s.uses[lo] if lo < s.uptr[i + 1] else NEVER


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _victim(s, m, protect):
    """LRU: the oldest resident not protected; LFU: the least used (then oldest); oracle: the
    one used furthest ahead (then the highest id). -1: none may go."""
    best, E = -1, s.stamp.shape[1]
    for v in range(E):
        if s.stamp[m, v] < 0 or protect[v]:
            continue
        if best < 0:
            best = v
        elif s.kind == LFU:
            if s.freq[m, v] < s.freq[m, best] or (s.freq[m, v] == s.freq[m, best] and s.stamp[m, v] < s.stamp[m, best]):
                best = v
        elif s.kind == ORACLE:
            a, b = _next_use(s, m, v), _next_use(s, m, best)
            if a > b or (a == b and v > best):
                best = v
        elif s.stamp[m, v] < s.stamp[m, best]:
            best = v
    return best


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _load(d, m, e, slot, v, kind):
    i = d.n[2]
    d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_victim[i], d.l_kind[i] = m, e, slot, v, kind
    d.n[2] = i + 1


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _gpu(d, e, slot):
    i = d.n[0]
    d.g_e[i], d.g_slot[i] = e, slot
    d.n[0] = i + 1


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _mask(protect, experts):
    for v in range(protect.size):
        protect[v] = False
    for e in experts:
        protect[e] = True


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _ensure(s, d, m, experts, kind, protect, reusable, placed, use_reusable):
    """Policy.ensure: make `experts` resident in block m; returns how many were placed (in `placed`)."""
    npl = 0
    for e in experts:
        if s.stamp[m, e] >= 0:
            _touch(s, m, e)
            continue
        v = -1
        if s.nfree[m] == 0:
            v = _victim(s, m, protect)
            if v < 0 and use_reusable:
                for r in reusable:
                    if s.stamp[m, r] >= 0:
                        v = r
                        break
                if v < 0:
                    for i in range(npl):
                        if s.stamp[m, placed[i]] >= 0:
                            v = placed[i]
                            break
            if v < 0:
                continue
        _load(d, m, e, _place(s, m, e, v), v, kind)
        placed[npl] = e
        npl += 1
    return npl


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _exact(s, d, m, needed, protect, hits, placed):
    """Policy.exact_plan: hits first (touched), then misses loaded on demand."""
    for e in needed:
        s.freq[m, e] += 1
    nh = 0
    for e in needed:
        if s.stamp[m, e] >= 0:
            hits[nh] = e
            nh += 1
    for i in range(nh):
        _touch(s, m, hits[i])
    hit_slots, misses = s.tmp1, s.tmp2
    for i in range(nh):
        hit_slots[i] = s.slot[m, hits[i]]
    k = 0
    for e in needed:
        if not _among(e, hits[:nh]):
            misses[k] = e
            k += 1
    _mask(protect, needed)
    first = d.n[2]
    npl = _ensure(s, d, m, misses[:k], DEMAND, protect, hits[:nh], placed, True)
    for i in range(nh):
        _gpu(d, hits[i], hit_slots[i])
    for i in range(npl):                       # a placed expert reads the slot of its (last) load
        e, slot = placed[i], -1
        for j in range(first, d.n[2]):
            if d.l_e[j] == e:
                slot = d.l_slot[j]
        _gpu(d, e, slot)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _among(e, xs):
    for x in xs:
        if x == e:
            return True
    return False


# the policies ------------------------------------------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _commit(s, d, m, predicted, protect, placed):
    n = min(predicted.size, s.nslots[m])
    chosen = predicted[:n]
    _mask(protect, chosen)
    _ensure(s, d, m, chosen, COMMIT_LOAD, protect, chosen[:0], placed, False)
    for i in range(n):
        s.committed[m, i] = chosen[i]
    s.ncommitted[m] = n


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
    if s.kind == COMMIT:
        for m in range(pd.M):
            s.ncommitted[m] = -1
        if decode:
            _commit(s, d, 0, pd.pred[pd.pred_ptr[p * pd.M]:pd.pred_ptr[p * pd.M + 1]], protect, placed)
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
    elif kind == COMMIT:
        if not s.scal[DECODE]:
            _exact(s, d, m, needed, protect, hits, placed)
            return
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
    elif kind == ADAPTIVE:
        if not s.scal[DECODE]:
            _exact(s, d, m, needed, protect, hits, placed)
            return
        nk = 0
        for j in range(needed.size):                        # the top-ranked, and the resident rest
            if j == 0 or s.stamp[m, needed[j]] >= 0:
                s.keep[nk] = needed[j]
                nk += 1
        _exact(s, d, m, s.keep[:nk], protect, hits, placed)
        d.skipped[d.n[3]] += needed.size - nk
    else:                                                   # oracle
        s.scal[AFTER] = s.scal[K]
        _exact(s, d, m, needed, protect, hits, placed)
        if m:
            _ahead(s, d, m - 1, s.scal[K] + 1, P, pd, protect, placed)


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
