"""A policy object's state as the compiled twins' arrays, and back; and decisions made by the
Python policy itself (any class without a twin), into the same `Decisions` buffers."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from cmoe.policy import policies as pol
from cmoe.policy.ahead import Ahead
from cmoe.sim.replay.twin_pool import AFTER, CLOCK, DECODE, KIND_OF, K, LOAD_KINDS, PassData, PolicyState
from cmoe.trace.pass_arrays import PassArrays

TWINS = {c: KIND_OF[c.name] for c in (pol.Upper, pol.OnDemand, pol.LruPrefetch, pol.LfuFallback, pol.Static,
                                      pol.Commit, pol.Oracle, pol.Adaptive, pol.AdaptiveAhead, pol.CommitAhead)}
_RANK = {k: i for i, k in enumerate(LOAD_KINDS)}


def has_twin(policy: pol.Policy) -> bool:
    """Exactly one of the built-in classes (a subclass may decide otherwise: it runs in Python)."""
    return type(policy) in TWINS


def pass_data(pa: PassArrays) -> PassData:
    return PassData(pa.decode, pa.need_ptr, pa.need, pa.votes, pa.pred_ptr, pa.pred, pa.num_layers, pa.ahead_ptr,
                    pa.ahead, pa.depth)


def _uses(pa: PassArrays, E: int) -> tuple[np.ndarray, np.ndarray]:
    """Oracle.uses as CSR over (m, e): the passes needing e in block m, ascending."""
    M = pa.num_layers
    pm = np.repeat(np.arange(pa.num_passes * M, dtype=np.int64), np.diff(pa.need_ptr))
    key = (pm % M) * E + pa.need
    order = np.argsort(key, kind="stable")
    ptr = np.zeros(M * E + 1, np.int64)
    np.cumsum(np.bincount(key, minlength=M * E), out=ptr[1:])
    return ptr, (pm // M)[order]


def _check_future(policy: pol.Oracle, pa: PassArrays) -> None:
    fut = policy.future
    if getattr(fut, "arrays", None) is pa:
        return
    assert len(fut) == pa.num_passes and all(
        tuple(map(tuple, fut[k])) == tuple(tuple(pa.needed(k, m).tolist()) for m in range(pa.num_layers))
        for k in range(pa.num_passes)), "the oracle's future disagrees with the trace"


def export(policy: pol.Policy, pa: PassArrays) -> PolicyState:
    lay = policy.layout
    M, E, S = len(lay.slots), policy.E, max(lay.slots)
    stamp, slot = np.full((M, E), -1, np.int64), np.zeros((M, E), np.int64)
    free, nfree = np.zeros((M, S), np.int64), np.zeros(M, np.int64)
    clock = 0
    for m, where in enumerate(policy.pool.where):
        for e, s in where.items():                      # OrderedDict order: LRU first
            clock += 1
            stamp[m, e], slot[m, e] = clock, s
        nfree[m] = len(policy.pool.free[m])
        free[m, :nfree[m]] = policy.pool.free[m]
    committed, ncommitted = np.zeros((M, E), np.int64), np.full(M, -1, np.int64)
    for m, chosen in enumerate(getattr(policy, "committed", None) or ()):
        if chosen is not None:
            committed[m, :len(chosen)], ncommitted[m] = chosen, len(chosen)
    uptr, uses = np.zeros(1, np.int64), np.zeros(1, np.int64)
    scal = np.array([clock, policy.decode, getattr(policy, "k", 0), getattr(policy, "after", 0),
                     policy.pool.occupancy()], np.int64)
    if isinstance(policy, pol.Oracle):
        _check_future(policy, pa)
        uptr, uses = _uses(pa, E)
    return PolicyState(np.int64(TWINS[type(policy)]), np.array(lay.slots, np.int64), stamp, slot, free, nfree,
                       np.array(policy.freq, np.int64).reshape(M, E), scal, committed, ncommitted, uptr, uses,
                       np.zeros(E, np.bool_), *(np.zeros(E, np.int64) for _ in range(5)), *_ahead_state(policy))


def _ahead_state(policy: pol.Policy) -> tuple:
    """(popularity, wanted, fetched, named, [depth, agree, top]) as arrays; zeros where no look-ahead."""
    M, E = len(policy.layout.slots), policy.E
    wanted, fresh, named = np.zeros((M, E), np.bool_), np.zeros((M, E), np.bool_), np.zeros((M, E), np.int64)
    ahd = np.zeros(3, np.int64)
    if isinstance(policy, Ahead):
        assert policy.depth * policy.top <= E, "a step's prefetches would overflow the decision buffers"
        for m in range(M):
            wanted[m, list(policy.wanted[m])] = True
            fresh[m, list(policy.fresh[m])] = True
            for e, n in policy.named[m].items():
                named[m, e] = n
        ahd[:] = policy.depth, policy.agree, policy.top
    return np.array(policy.popularity, np.int64).reshape(M, E), wanted, fresh, named, ahd


def restore(policy: pol.Policy, s: PolicyState) -> None:
    """Write the twin's state back, so the object ends as the Python run would leave it."""
    for m in range(len(policy.layout.slots)):
        res = np.nonzero(s.stamp[m] >= 0)[0]
        res = res[np.argsort(s.stamp[m, res])]
        policy.pool.where[m] = OrderedDict((int(e), int(s.slot[m, e])) for e in res)
        policy.pool.free[m] = s.free[m, :s.nfree[m]].tolist()
        policy.freq[m][:] = s.freq[m].tolist()
    policy.decode = bool(s.scal[DECODE])
    if isinstance(policy, pol.Commit):
        policy.committed = [s.committed[m, :n].tolist() if n >= 0 else None for m, n in enumerate(s.ncommitted.tolist())]
    if isinstance(policy, pol.Oracle):
        policy.k, policy.after = int(s.scal[K]), int(s.scal[AFTER])
    if isinstance(policy, Ahead):
        policy.wanted = [set(np.nonzero(row)[0].tolist()) for row in s.wanted]
        policy.fresh = [set(np.nonzero(row)[0].tolist()) for row in s.fresh]
        policy.named = [{int(e): int(row[e]) for e in np.nonzero(row)[0]} for row in s.named]
    assert s.scal[CLOCK] >= 0


def decide_python(policy: pol.Policy, pa: PassArrays, d, p0: int, p1: int) -> None:
    """What `decide.decide` writes, from the policy object's own `begin_pass` and `plan`."""
    M = pa.num_layers
    n = [0, 0, 0, 0]

    def loads(lds):
        for ld in lds:
            i = n[2]
            d.l_layer[i], d.l_e[i], d.l_slot[i] = ld.layer, ld.expert, ld.slot
            d.l_victim[i], d.l_kind[i] = -1 if ld.victim is None else ld.victim, _RANK[ld.kind]
            n[2] += 1

    def mark(j):
        d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = n[0], n[1], n[2]

    for p in range(p0, p1):
        j = (p - p0) * (M + 1)
        mark(j)
        d.skipped[j] = 0
        deep = {"ahead": pa.seen(p, 0, policy.depth)} if policy.depth > 1 else {}
        loads(policy.begin_pass(bool(pa.decode[p]), pa.pred[pa.pred_ptr[p * M]:pa.pred_ptr[p * M + 1]].tolist(), **deep))
        for m in range(M):
            mark(j + 1 + m)
            i = p * M + m
            nxt = pa.pred[pa.pred_ptr[i + 1]:pa.pred_ptr[i + 2]].tolist() if m + 1 < M else None
            deep = {"ahead": pa.seen(p, m + 1, policy.depth)} if policy.depth > 1 else {}
            plan = policy.plan(m, pa.need[pa.need_ptr[i]:pa.need_ptr[i + 1]].tolist(), nxt, **deep)
            for e in plan.gpu:
                d.g_e[n[0]], d.g_slot[n[0]] = e, plan.slots[e]
                n[0] += 1
            for e in plan.cpu:
                d.c_e[n[1]] = e
                n[1] += 1
            loads(plan.loads)
            d.skipped[j + 1 + m] = len(plan.skipped)
        d.occupancy[p - p0] = policy.pool.occupancy()
    mark((p1 - p0) * (M + 1))
    d.n[:] = n[0], n[1], n[2], (p1 - p0) * (M + 1)
