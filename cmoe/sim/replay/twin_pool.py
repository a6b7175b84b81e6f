"""The compiled twins' state and pool mechanics (see `decide.py` for the policies and why
compiled): the state a policy object exports, the buffers decisions are written into, and what
`Policy.ensure`, `exact_plan` and the victim rules do, over arrays.

Pool state per block m (legend: M blocks, E experts, S most slots of a block, D distances of
prediction): `stamp[m, e]` the expert's place in LRU order (larger = more recent; -1 not
resident, the OrderedDict's order), `slot[m, e]`, and the free slots `free[m, :nfree[m]]`
(popped from the end, as the list is). A decision run writes, per step (a pass's `begin_pass`,
then each layer's `plan`), the GPU experts and their slots, the CPU experts, the loads and the
skipped count (`Decisions`, CSR).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

UPPER, ONDEMAND, LRU_PREFETCH, LFU, STATIC, COMMIT, ORACLE, ADAPTIVE, ADAPTIVE_AHEAD, COMMIT_AHEAD = range(10)
KIND_OF = {"upper": UPPER, "ondemand": ONDEMAND, "lru-prefetch": LRU_PREFETCH, "lfu-fallback": LFU,
           "static": STATIC, "commit": COMMIT, "oracle": ORACLE, "adaptive": ADAPTIVE,
           "adaptive-ahead": ADAPTIVE_AHEAD, "commit-ahead": COMMIT_AHEAD}
LOAD_KINDS = ("demand", "commit", "prefetch", "admit")      # code = the SimPy model's priority rank
DEMAND, COMMIT_LOAD, PREFETCH, ADMIT = range(4)
NEVER = np.int64(1) << 62                                    # next use of an expert never used again
CLOCK, DECODE, K, AFTER, OCC = range(5)                      # PolicyState.scal (OCC: experts resident)
DEPTH, AGREE, TOP = range(3)                                 # PolicyState.ahd (cmoe.policy.ahead's attributes)

PolicyState = namedtuple("PolicyState", [
    "kind", "nslots", "stamp", "slot", "free", "nfree", "freq", "scal",
    "committed", "ncommitted",        # commit: [M, E] chosen experts, [M] how many (-1: none)
    "uptr", "uses",                   # oracle: CSR over (m, e) of the passes that need e in block m
    "protect", "hits", "placed", "tmp1", "tmp2", "keep",   # scratch, [E] each (compiled code allocates nothing)
    "pop", "wanted", "fresh", "named", "ahd",   # look-ahead: [M, E] popularity, wanted, fetched, named; [3] params
])
Decisions = namedtuple("Decisions", [
    "n",                              # [4] counts written: gpu, cpu, loads, steps
    "g_ptr", "g_e", "g_slot",         # per step: GPU experts in order and the slot each is read from
    "c_ptr", "c_e",                   # CPU experts
    "l_ptr", "l_layer", "l_e", "l_slot", "l_victim", "l_kind",   # loads in issue order (victim -1: a free slot)
    "skipped", "occupancy",           # per step; per pass: experts resident at its end
])
PassData = namedtuple("PassData", ["decode", "need_ptr", "need", "votes", "pred_ptr", "pred", "M",
                                   "ahead_ptr", "ahead", "D"])      # (p*M + m)*D + k-1: layer m at distance k


def decisions(steps: int, passes: int, E: int) -> Decisions:
    """Buffers for `steps` steps: a step's GPU and CPU experts are at most E each, its loads 2E and
    a look-ahead policy's prefetches E more (depth x top <= E, `state.export` checks)."""
    z = lambda n: np.zeros(n, np.int64)
    L = 3 * steps * E
    return Decisions(z(4), z(steps + 1), z(steps * E), z(steps * E), z(steps + 1), z(steps * E),
                     z(steps + 1), z(L), z(L), z(L), z(L), z(L), z(steps), z(passes))


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
    one used furthest ahead (then the highest id); look-ahead: `_victim_ahead`. -1: none may go."""
    if s.kind >= ADAPTIVE_AHEAD:
        return _victim_ahead(s, m, protect)
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
def _victim_ahead(s, m, protect):
    """Ahead.victim: never a fetched one; the least popular (then lowest id) nobody wants, else
    the oldest."""
    free, cold = -1, -1
    for v in range(s.stamp.shape[1]):
        if s.stamp[m, v] < 0 or protect[v] or s.fresh[m, v]:
            continue
        if free < 0 or s.stamp[m, v] < s.stamp[m, free]:
            free = v
        if not s.wanted[m, v] and (cold < 0 or s.pop[m, v] < s.pop[m, cold]):
            cold = v
    return cold if cold >= 0 else free


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
