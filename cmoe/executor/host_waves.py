"""The compiled host program's reading of a layer's decisions (`cmoe.executor.host_program`): which
of its loads wait for one of its own launches, its launches (`cmoe.policy.waves`, over the twin's
buffers), and the slots' snapshot the plan records keep."""

from __future__ import annotations

import cmoe.sim.replay  # noqa: F401,E402  (first: it sets numba's cache folder, `cmoe.sim.replay`)

from numba import njit


@njit(cache=True, _nrt=False)
def _wave_of(d, g0, g1, l0, l1, m, waves):
    """`cmoe.policy.waves.waves` over the layer's GPU experts d.g_e[g0:g1] and its deferred loads
    (`_deferred`): each expert's launch in `waves`; returns how many launches (0: no GPU expert)."""
    n = 0
    for i in range(g0, g1):
        e, v = d.g_e[i], -1
        for j in range(l0, l1):                           # the deferred load that brings e
            if _deferred(d, j, m, g0, g1) and d.l_e[j] == e:
                v = d.l_victim[j]
        w = 0
        if v >= 0:
            k = _index(d.g_e, g0, i, v)
            if k >= 0:
                w = waves[k - g0] + 1
        waves[i - g0] = w
        n = max(n, w + 1)
    return n


@njit(cache=True, _nrt=False)
def _deferred(d, i, m, g0, g1):
    """Load i waits for a launch of layer m: into this layer, over one of its GPU experts."""
    return d.l_layer[i] == m and _index(d.g_e, g0, g1, d.l_victim[i]) >= 0


@njit(cache=True, _nrt=False)
def _loads_now(d, l0, l1, m, e):
    """1 when this layer's own plan loads e (its kernel waits on its own copy)."""
    for q in range(l0, l1):
        if d.l_layer[q] == m and d.l_e[q] == e:
            return 1
    return 0


@njit(cache=True, _nrt=False)
def _index(xs, a, b, e):
    for i in range(a, b):
        if xs[i] == e:
            return i
    return -1


@njit(cache=True, _nrt=False)
def _snapshot(pool, s, b, m, E):
    """Layer m's slots after its step: on the device (`physical`) and in the policy's index."""
    for q in range(b.phys.shape[1]):
        b.phys[m, q], b.logi[m, q] = pool.expert[m, q], -1
    for e in range(E):
        if s.stamp[m, e] >= 0:
            b.logi[m, s.slot[m, e]] = e
