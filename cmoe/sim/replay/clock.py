"""The SimPy model's clock, compiled: the compute process of `cmoe.sim.engine.Simulation` as
straight-line code, and its copy engines, queue and events as a small event list that is
processed exactly as SimPy processes its own, so every span lands on the same float.

How it stays identical to SimPy, not just close:
- Events are ordered as SimPy orders them, by (time, priority, id), the id counting every
  event the model schedules, in the order it schedules them: timeouts, the Put and Get events of
  the copy queue (a waiting copy engine is served when the Put is *processed*, and only the
  first waiting engine is tried, as simpy's `Store` does), a load's ready event, the drain event.
  Ties between a copy landing and the compute stream resuming at the same instant therefore go
  the same way (they decide whether a kernel runs slower, `copy_*_slowdown`, and whether an
  expert is a hit).
- Every time is computed with SimPy's arithmetic: a timeout to `t` lands on `now + (t - now)`,
  and the compute stream's sums and maxima follow the engine's expressions term by term
  (`pmax` is Python's `max`: the first of equals).
- The compute process "yields" by scheduling its wake-up and processing other events until that
  wake-up is the next one (`_advance`); SimPy's generator does the same.
Decisions come from `decide.Decisions` (the compiled twins or the Python policies); costs from
`cost_tables` (computed in Python with the profile's own methods where a curve or a log is
involved). Legend: M MoE layers, E experts, S slots per block, L loads alive (a ring).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

# events, in the order SimPy's processes would meet them
EV_COMPUTE, EV_INIT, EV_SLOT, EV_COPY, EV_PUT, EV_GET, EV_READY, EV_DRAINED = range(8)
URGENT, NORMAL = 0, 1
W_TIMEOUT, W_READY, W_DRAINED, W_NONE = range(4)
# Clock.F: now, the compute process's two clocks and last pass end, the link time of loads no engine has started,
# when the copies now moving will have landed, when the last CPU expert ended, the pass's latest read-back wait
NOW, H_, G_, PREV_END, QUEUED, BUSY_UNTIL, CPU_END, LAST_WAIT = range(8)
# Clock.I
EID, IN_FLIGHT, DRAINED, PASS_INDEX, SEQ, NLOAD, NHEAP, NQ, QHEAD, NGETQ, ERR, NSPAN = range(12)
# span codes (streams: 0 compute, 1 + i copy engine i, 1 + engines cpu; ops below)
OPS = ("attention", "dense", "route", "expert", "roundtrip", "cpu_expert", "head", "load")
OP_ATTN, OP_DENSE, OP_ROUTE, OP_EXPERT, OP_RT, OP_CPU, OP_HEAD, OP_LOAD = range(8)
ERR_TWICE, ERR_RING = 1, 2

Clock = namedtuple("Clock", [
    "F", "I",
    "ht", "hp", "he", "hk", "ha",                          # event heap: time, priority, id, kind, argument
    "qf", "qk1", "qk2",                                    # copy queue: FIFO ring, or heap of (pass, layer, rank) and seq
    "getq",                                                # copy engines waiting on the queue, in order
    "lm", "le", "lslot", "lk1", "lnext",                   # loads alive, by id & mask
    "rinst", "rtrig", "rland",                             # [M, E] the latest ready event of (layer, expert), triggered, when
    "spend", "swrit", "sfree", "swh", "swt",               # [M, S] per slot: pending reads, writes, free_at, waiting loads
    "eitem", "estart", "eend",                             # per copy engine (eend: its latest landing)
    "wv",                                                  # [E] scratch: the wave of each GPU expert of a layer
])
Costs = namedtuple("Costs", [
    "h2d", "h2dq", "xfix", "ebytes", "ctab", "moe_layers", # [M, E] copy us alone, queued, expert us at one row, bytes;
    #                                                        CPU expert us [class (xcls), rows]; [M]
    "hwf", "hwi",                                          # profile scalars (below)
    "layer_gpu", "layer_host", "route_host", "dense_gpu", "dense_host", "attn_gpu", "attn_host",
    "ntok", "decode", "commit_decode", "queued", "all_rows", "votes_ptr", "votes_e", "votes_n",   # per pass (queued:
    # a decode pass the host does not wait for, `pass_overlap`); votes per (pass, layer)
    "xtab", "xcls", "htab",                                # expert us [class, rows], [M, E] class; host issue us [rows]
    "wfix",                                                # [M, E] an expert's share of a fused launch at 0 rows
    "wcnt",                                                # a fused launch's own cost by its expert count [0..E]
    "wake",                                                # [K, 2] (wait us, factor): `HardwareProfile.host_wake`
    "route_wake", "wake_base",                             # per pass: the route step a wait slows, its factor as measured
    "cpu_wake",                                            # [K, 2] (idle us, extra us): `HardwareProfile.cpu_wake_us`
    "half_rt", "pass_wake", "boundary_wake",               # per pass: half its round trip (`roundtrip`); [K, 2]
])                                                         # (pass us / wait us, extra us): `pass_start_extra_us`, `boundary_extra_us`
# Costs.hwf
(SLOW, HOST_LOAD, HX0, HX1, TAIL, TFLOPS, HOST_SYNC, PASS_START, HOST_PASS_START, HEAD, HOST_HEAD,
 WAVE, WAVE_ROW, OWA_GPU, PASS_GAP, COMMIT_GPU, COMMIT_GPU_COPY, COMMIT_START, ATTN_SLOW, RB_COPY, LAUNCH_COPY,
 CPU_LEAD, CPU_GAP, CPU_TAIL, CHAINED_GAP, STARTUP_AFTER, START_COPY, COPY_LAUNCH) = range(28)
# Costs.hwi
ENGINES, FIFO, ON_HOST, PARAMS, KEEP, HEAD_SPAN, SILENT, AHEAD = range(8)
Out = namedtuple("Out", [
    "sp_pass", "sp_layer", "sp_stream", "sp_op", "sp_expert", "sp_start", "sp_end", "sp_bytes", "sp_m", "sp_slot",
    "hits", "late", "demand", "fallbacks", "skipped", "loads", "bytes_moved", "stall", "pass_us",   # per pass
])


def new_clock(M: int, E: int, S: int, engines: int, ring: int) -> Clock:
    L = 1 << max(4, int(ring - 1).bit_length())
    hcap = 2 * L + 4 * engines + 16
    zi, zf = (lambda *s: np.zeros(s, np.int64)), (lambda *s: np.zeros(s, np.float64))
    F = zf(8)
    F[CPU_END] = -np.inf                                   # no CPU expert yet: as long idle as can be
    return Clock(F, zi(12), zf(hcap), zi(hcap), zi(hcap), zi(hcap), zi(hcap), zi(L), zi(L), zi(L), zi(engines + 1),
                 zi(L), zi(L), zi(L), zi(L), zi(L), np.full((M, E), -1, np.int64), np.zeros((M, E), np.bool_), zf(M, E),
                 zi(M, S), zi(M, S), zf(M, S), np.full((M, S), -1, np.int64), np.full((M, S), -1, np.int64),
                 zi(engines), zf(engines), np.full(engines, -1.0), zi(E))


SPAN_DTYPES = (np.int32, np.int16, np.int8, np.int8, np.int16, np.float64, np.float64, np.int64, np.int16, np.int16)


def new_out(spans: int, passes: int) -> Out:
    zi, zf = (lambda n: np.zeros(n, np.int64)), (lambda n: np.zeros(n, np.float64))
    return Out(*(np.zeros(spans, t) for t in SPAN_DTYPES), zi(passes), zi(passes), zi(passes), zi(passes),
               zi(passes), zi(passes), zi(passes), zf(passes), zf(passes))


@njit(cache=True, inline="always", _nrt=False)
def pmax(a, b):
    """Python's max(a, b): b only when strictly larger."""
    return b if b > a else a


# the event heap, ordered by (time, priority, id) ---------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _less(c, i, j):
    if c.ht[i] != c.ht[j]:
        return c.ht[i] < c.ht[j]
    if c.hp[i] != c.hp[j]:
        return c.hp[i] < c.hp[j]
    return c.he[i] < c.he[j]


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _swap(c, i, j):
    c.ht[i], c.ht[j] = c.ht[j], c.ht[i]
    c.hp[i], c.hp[j] = c.hp[j], c.hp[i]
    c.he[i], c.he[j] = c.he[j], c.he[i]
    c.hk[i], c.hk[j] = c.hk[j], c.hk[i]
    c.ha[i], c.ha[j] = c.ha[j], c.ha[i]


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _schedule(c, delay, prio, kind, arg):
    """env.schedule: at now + delay, with the next event id."""
    i = c.I[NHEAP]
    if i >= c.ht.size:
        c.I[ERR] = ERR_RING
        return
    c.ht[i], c.hp[i], c.he[i], c.hk[i], c.ha[i] = c.F[NOW] + delay, prio, c.I[EID], kind, arg
    c.I[EID] += 1
    c.I[NHEAP] = i + 1
    while i > 0:
        up = (i - 1) >> 1
        if not _less(c, i, up):
            break
        _swap(c, i, up)
        i = up


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _pop(c):
    """Remove the first event; its time becomes now. Returns (kind, argument)."""
    kind, arg = c.hk[0], c.ha[0]
    c.F[NOW] = c.ht[0]
    n = c.I[NHEAP] - 1
    c.I[NHEAP] = n
    if n:
        _swap(c, 0, n)
        i = 0
        while True:
            a, b, best = 2 * i + 1, 2 * i + 2, i
            if a < n and _less(c, a, best):
                best = a
            if b < n and _less(c, b, best):
                best = b
            if best == i:
                break
            _swap(c, i, best)
            i = best
    return kind, arg


# the copy queue (simpy Store or PriorityStore) ------------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _q_push(c, x, ld):
    mask = c.lm.size - 1
    n = c.I[NQ]
    if x.hwi[FIFO]:
        c.qf[(c.I[QHEAD] + n) & mask] = ld
        c.I[NQ] = n + 1
        return
    i = n
    c.qf[i], c.qk1[i], c.qk2[i] = ld, c.lk1[ld & mask], ld
    c.I[NQ] = n + 1
    while i > 0:
        up = (i - 1) >> 1
        if (c.qk1[i], c.qk2[i]) >= (c.qk1[up], c.qk2[up]):
            break
        c.qf[i], c.qf[up] = c.qf[up], c.qf[i]
        c.qk1[i], c.qk1[up] = c.qk1[up], c.qk1[i]
        c.qk2[i], c.qk2[up] = c.qk2[up], c.qk2[i]
        i = up


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _q_pop(c, x):
    mask = c.lm.size - 1
    n = c.I[NQ] - 1
    c.I[NQ] = n
    if x.hwi[FIFO]:
        ld = c.qf[c.I[QHEAD]]
        c.I[QHEAD] = (c.I[QHEAD] + 1) & mask
        return ld
    ld = c.qf[0]
    c.qf[0], c.qk1[0], c.qk2[0] = c.qf[n], c.qk1[n], c.qk2[n]
    i = 0
    while True:
        a, b, best = 2 * i + 1, 2 * i + 2, i
        if a < n and (c.qk1[a], c.qk2[a]) < (c.qk1[best], c.qk2[best]):
            best = a
        if b < n and (c.qk1[b], c.qk2[b]) < (c.qk1[best], c.qk2[best]):
            best = b
        if best == i:
            break
        c.qf[i], c.qf[best] = c.qf[best], c.qf[i]
        c.qk1[i], c.qk1[best] = c.qk1[best], c.qk1[i]
        c.qk2[i], c.qk2[best] = c.qk2[best], c.qk2[i]
        i = best
    return ld


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _put(c, x, ld):
    """queue.put: the item is stored at once, the Put event is scheduled (it serves a waiting engine)."""
    _q_push(c, x, ld)
    _schedule(c, 0.0, NORMAL, EV_PUT, 0)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _trigger_get(c, x):
    """Store._trigger_get: only the first waiting engine is tried."""
    if c.I[NGETQ] and c.I[NQ]:
        eng = c.getq[0]
        for i in range(c.I[NGETQ] - 1):
            c.getq[i] = c.getq[i + 1]
        c.I[NGETQ] -= 1
        c.eitem[eng] = _q_pop(c, x)
        _schedule(c, 0.0, NORMAL, EV_GET, eng)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _get(c, x, eng):
    c.getq[c.I[NGETQ]] = eng
    c.I[NGETQ] += 1
    _trigger_get(c, x)


# the copy engines -------------------------------------------------------------------------------
@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _span(c, o, x, p, layer, stream, op, expert, start, end, nbytes, m, slot):
    if not x.hwi[KEEP]:
        return
    i = c.I[NSPAN]
    if i >= o.sp_pass.size:
        c.I[ERR] = ERR_RING
        return
    o.sp_pass[i], o.sp_layer[i], o.sp_stream[i], o.sp_op[i], o.sp_expert[i] = p, layer, stream, op, expert
    o.sp_start[i], o.sp_end[i], o.sp_bytes[i], o.sp_m[i], o.sp_slot[i] = start, end, nbytes, m, slot
    c.I[NSPAN] = i + 1


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _got(c, x, eng):
    """An engine has its load: it waits for the slot's last reader, then copies."""
    ld = c.eitem[eng] & (c.lm.size - 1)
    free_at = c.sfree[c.lm[ld], c.lslot[ld]]
    if free_at > c.F[NOW]:
        _schedule(c, free_at - c.F[NOW], NORMAL, EV_SLOT, eng)
    else:
        _start(c, x, eng)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _start(c, x, eng):
    ld = c.eitem[eng] & (c.lm.size - 1)
    start = c.F[NOW]
    c.estart[eng] = start
    m, e = c.lm[ld], c.le[ld]
    dur = x.h2dq[m, e] if start == c.eend[eng] else x.h2d[m, e]     # straight on from the last: queued
    c.F[QUEUED] -= x.h2d[m, e]
    c.F[BUSY_UNTIL] = pmax(c.F[BUSY_UNTIL], start + dur)
    _schedule(c, dur, NORMAL, EV_COPY, eng)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _landed(c, x, o, eng):
    ld = c.eitem[eng] & (c.lm.size - 1)
    m, e, s = c.lm[ld], c.le[ld], c.lslot[ld]
    _span(c, o, x, c.I[PASS_INDEX], x.moe_layers[m], 1 + eng, OP_LOAD, e, c.estart[eng], c.F[NOW],
          x.ebytes[m, e], m, s)
    if c.rtrig[m, e]:
        c.I[ERR] = ERR_TWICE                 # SimPy would raise: the (layer, expert) event triggered twice
    c.rtrig[m, e] = True
    c.rland[m, e] = c.F[NOW]
    _schedule(c, 0.0, NORMAL, EV_READY, c.rinst[m, e])
    c.I[IN_FLIGHT] -= 1
    if c.I[IN_FLIGHT] == 0 and c.I[DRAINED]:
        _schedule(c, 0.0, NORMAL, EV_DRAINED, 0)
        c.I[DRAINED] = 0
    if not x.hwi[FIFO]:
        c.swrit[m, s] -= 1
        _release(c, x, m, s)
    c.eend[eng] = c.F[NOW]
    _get(c, x, eng)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _release(c, x, m, s):
    if c.spend[m, s] == 0 and c.swrit[m, s] == 0 and c.swh[m, s] >= 0:
        c.swrit[m, s] += 1
        ld = c.swh[m, s]
        c.swh[m, s] = c.lnext[ld & (c.lm.size - 1)]
        if c.swh[m, s] < 0:
            c.swt[m, s] = -1
        _put(c, x, ld)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _advance(c, x, o, wait, arg):
    """Process events until the compute process's wake-up (W_NONE: until none is left)."""
    while c.I[NHEAP]:
        kind, a = _pop(c)
        if kind == EV_COMPUTE:
            return
        if kind == EV_READY:
            if wait == W_READY and a == arg:
                return
        elif kind == EV_DRAINED:
            return
        elif kind == EV_PUT:
            _trigger_get(c, x)
        elif kind == EV_GET:
            _got(c, x, a)
        elif kind == EV_SLOT:
            _start(c, x, a)
        elif kind == EV_COPY:
            _landed(c, x, o, a)
        elif kind == EV_INIT:
            _get(c, x, a)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _sync(c, x, o, t):
    """yield env.timeout(t - now), if t lies ahead."""
    if t > c.F[NOW]:
        _schedule(c, t - c.F[NOW], NORMAL, EV_COMPUTE, 0)
        _advance(c, x, o, W_TIMEOUT, 0)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _issue(c, x, o, m, e, slot, rank, p, M, planned=False):
    """Simulation._issue: queue a load; returns the host time issuing it costs (`planned`: its
    `host_load_us` paid by the caller before the copy)."""
    mask = c.lm.size - 1
    ld = c.I[NLOAD]
    if c.I[IN_FLIGHT] >= mask:
        c.I[ERR] = ERR_RING
    c.I[NLOAD] = ld + 1
    i = ld & mask
    c.I[SEQ] += 1
    c.lm[i], c.le[i], c.lslot[i], c.lk1[i], c.lnext[i] = m, e, slot, (p * (M + 1) + m) * 4 + rank, -1
    c.rinst[m, e], c.rtrig[m, e] = ld, False
    c.I[IN_FLIGHT] += 1
    o.loads[p] += 1
    o.bytes_moved[p] += x.ebytes[m, e]
    c.F[QUEUED] += x.h2d[m, e]
    cost = 0.0 if planned else x.hwf[HOST_LOAD]
    if x.hwi[ON_HOST]:
        cost += x.h2d[m, e]
    if x.hwi[FIFO]:
        _put(c, x, ld)
        return cost
    if c.spend[m, slot] == 0 and c.swrit[m, slot] == 0:
        c.swrit[m, slot] += 1
        _put(c, x, ld)
    elif c.swh[m, slot] < 0:
        c.swh[m, slot] = c.swt[m, slot] = ld
    else:
        c.lnext[c.swt[m, slot] & mask] = ld
        c.swt[m, slot] = ld
    return cost


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def copying(c, x, t):
    """Simulation._copying: will a copy be moving when an op starts at t? Queued copies are
    taken to follow the moving ones back to back, spread over the copy engines."""
    busy = pmax(c.F[BUSY_UNTIL], c.F[NOW]) + c.F[QUEUED] / x.hwi[ENGINES]
    return t < busy


@njit(cache=True, _nrt=False)
def start(c, x, o):
    """The processes' Initialize events: the copy engines first, then the compute process."""
    for eng in range(x.hwi[ENGINES]):
        _schedule(c, 0.0, URGENT, EV_INIT, eng)
    _schedule(c, 0.0, URGENT, EV_COMPUTE, 0)
    _advance(c, x, o, W_TIMEOUT, 0)


@njit(cache=True, _nrt=False)
def finish(c, x, o):
    """After the last pass: the copies still in flight land (SimPy runs until no event is left)."""
    _advance(c, x, o, W_NONE, 0)
