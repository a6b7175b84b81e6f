"""The compute process of `cmoe.sim.engine.Simulation` (`_compute` and the per-layer steps it
runs: `_begin_pass`, `_dense_layers`, `_moe_layer`, `_ahead_layer`, `_gpu_experts`,
`_cpu_experts`), line for line, in one loop over decisions already made (`decide.Decisions`)
and the clock of `clock.py`. Read the two side by side: the names (H, G, last, t_in, due, ...)
and the order of every sum are the engine's, and each step is a function as in the engine
(`_begin`, `_layer`, `_kernels`, `_waves`, `_ahead`, `_cpu`)."""

from __future__ import annotations

from numba import njit

from cmoe.core.hw_math import beside_copy
from cmoe.sim.replay.clock import (CHAINED_GAP, CPU_END, CPU_GAP, CPU_LEAD, CPU_TAIL, DRAINED, ENGINES, ERR, FIFO, G_, H_, HEAD, HEAD_SPAN, HOST_HEAD,
                                   AHEAD, COMMIT_GPU, COMMIT_GPU_COPY, COMMIT_START, HOST_LOAD, HOST_PASS_START, HOST_SYNC,
                                   IN_FLIGHT, LAST_WAIT, NOW, OP_ATTN, SILENT,
                                   OP_CPU, OP_DENSE, OP_EXPERT, OP_HEAD, OP_ROUTE, OP_RT, OWA_GPU, PASS_GAP,
                                   PASS_INDEX, PASS_START, PREV_END, SLOW, STARTUP_AFTER, START_COPY, ATTN_SLOW, RB_COPY, LAUNCH_COPY, TAIL, WAVE, WAVE_ROW,
                                   COPY_LAUNCH,
                                   W_DRAINED, W_READY, _advance, copying, _issue, _release, _span, _sync, pmax)


# the profile's own arithmetic, compiled (-1 in COPY_LAUNCH: not measured, as None is there)
_beside_copy = njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")(beside_copy)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _votes(x, p, m, e, M):
    """votes.get(e, 1): the tokens routed to e in pass p, layer m."""
    i = p * M + m
    for j in range(x.votes_ptr[i], x.votes_ptr[i + 1]):
        if x.votes_e[j] == e:
            return x.votes_n[j]
    return 1


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _flat(t, w):
    """`HardwareProfile.host_wake(w)` and `cpu_wake_us(w)`: `table_us` over a table t with the wait
    held at its last point (one point, (0, 1) or (0, 0), where the profile has none)."""
    k = t.shape[0]
    w = min(w, t[k - 1, 0])
    if w <= t[0, 0] or k == 1:
        return t[0, 1]
    for i in range(k - 1):
        x0, y0, x1, y1 = t[i, 0], t[i, 1], t[i + 1, 0], t[i + 1, 1]
        if w <= x1:
            return y0 + (y1 - y0) * (w - x0) / (x1 - x0)
    return t[k - 1, 1]


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _wake(x, w):
    return _flat(x.wake, w)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _wake_extra(x, p, w):
    """`costs.wake_extra`: what a wait of w adds to pass p's route step."""
    return x.route_wake[p] * (_wake(x, w) / x.wake_base[p] - 1.0)


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _own(d, l0, l1, m, e):
    """Is e in {ld.expert for ld in plan.loads if ld.layer == m}?"""
    for i in range(l0, l1):
        if d.l_layer[i] == m and d.l_e[i] == e:
            return True
    return False


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _deferred(d, g0, g1, i, m, fifo):
    """FIFO: a load overwriting an expert this layer still reads waits behind its kernel."""
    if not fifo or d.l_layer[i] != m or d.l_victim[i] < 0:
        return False
    for g in range(g0, g1):
        if d.g_e[g] == d.l_victim[i]:
            return True
    return False


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _ran(o, p, demand, wait):
    """`RunRecord.ran(p, *classify(...))`: a GPU expert of pass p counted as a demand load, late or
    a hit, and its wait."""
    if demand:
        o.demand[p] += 1
    elif wait > 0:
        o.late[p] += 1
    else:
        o.hits[p] += 1
    o.stall[p] += wait


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _await_copy(c, x, o, m, e, due):
    """`Simulation._await_copy`: (whether a copy was pending at `due`, when it landed)."""
    if c.rinst[m, e] >= 0 and not c.rtrig[m, e] and due > c.F[NOW]:
        _sync(c, x, o, due)                 # the copy may land before the kernel is due
    if c.rinst[m, e] >= 0 and not c.rtrig[m, e]:
        _advance(c, x, o, W_READY, c.rinst[m, e])
        return True, c.F[NOW]
    if c.rinst[m, e] >= 0 and c.rland[m, e] > due:
        return True, c.rland[m, e]
    return False, 0.0


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _waves(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, n, slow, M, silent, own, extra, table):
    """`Simulation._gpu_waves`, line for line: the GPU experts in fused launches (`waves`: an
    expert loaded behind a victim of this layer runs in the launch after the victim's). `own`:
    count this layer's own loads as demand (the read-back path; commit's ahead path has none);
    `table`: what a launch issued beside a moving load waits more (the read-back path's)."""
    nw = 0
    for g in range(g0, g1):
        w = 0
        for i in range(l0, l1):
            if d.l_e[i] == d.g_e[g] and _deferred(d, g0, g1, i, m, True):
                for h in range(g0, g):
                    if d.g_e[h] == d.l_victim[i]:
                        w = c.wv[h - g0] + 1
                        break
                break
        c.wv[g - g0] = w
        nw = max(nw, w + 1)
    for k in range(nw):
        due = pmax(G, H)
        cnt = 0
        for g in range(g0, g1):
            cnt += c.wv[g - g0] == k
        start, dur = due, x.wcnt[cnt] + extra          # the launch's own cost first, as the engine sums it
        for g in range(g0, g1):
            if c.wv[g - g0] != k:
                continue
            e = d.g_e[g]
            waited, landed = _await_copy(c, x, o, m, e, due)
            wait = pmax(0.0, landed - due) if waited else 0.0
            _ran(o, p, own and _own(d, l0, l1, m, e), wait)
            start = pmax(start, due + wait)
            r = n if x.all_rows[p] else _votes(x, p, m, e, M)
            dur += x.wfix[m, e] + x.hwf[WAVE_ROW] * r
        issue = 0.0 if silent else x.htab[n]              # a launch's host cost goes by the pass's tokens
        launched = H + issue - x.hwf[TAIL]
        if table != 0.0 and c.I[IN_FLIGHT] and copying(c, x, launched):
            launched += table                           # its slot table's copy waits behind the load's
        start = pmax(start, launched)
        if c.I[IN_FLIGHT] and copying(c, x, start):       # `HardwareProfile.wave_beside_copy`
            dur = _beside_copy(dur, extra, slow, x.hwf[COPY_LAUNCH])
        G = start + dur
        H += issue
        step = (G - start) / cnt
        j = 0
        for g in range(g0, g1):
            if c.wv[g - g0] != k:
                continue
            e, slot = d.g_e[g], d.g_slot[g]
            b = G if j == cnt - 1 else start + (j + 1) * step
            _span(c, o, x, p, dl, 0, OP_EXPERT, e, start + j * step, b, x.ebytes[m, e], m, slot)
            c.sfree[m, slot] = pmax(c.sfree[m, slot], G)
            j += 1
        for g in range(g0, g1):
            if c.wv[g - g0] != k:
                continue
            for i in range(l0, l1):
                if _deferred(d, g0, g1, i, m, True) and d.l_victim[i] == d.g_e[g]:
                    _sync(c, x, o, H)
                    H += _issue(c, x, o, d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_kind[i], p, M)
    return H, G


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False)
def _ahead(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, t_in, n, slow, M):
    """`Simulation._ahead_layer`, line for line: commit's experts issued before its read-back."""
    Hx = H
    moving = x.hwf[COMMIT_GPU_COPY] != 0.0 and c.I[IN_FLIGHT] != 0 and copying(c, x, pmax(G, Hx))
    tot = 0.0
    if x.hwf[WAVE]:                                     # one launch, issued once, priced by the pass's tokens
        tot = x.htab[n] if g1 > g0 else 0.0
    else:
        for g in range(g0, g1):
            rows = n if x.all_rows[p] else _votes(x, p, m, d.g_e[g], M)
            tot += x.htab[rows]
    c.F[LAST_WAIT] = pmax(t_in - (H + tot), 0.0)
    Hr = pmax(H + tot, t_in) + x.route_host[p] + _wake_extra(x, p, c.F[LAST_WAIT])
    for i in range(l0, l1):
        if Hr > c.F[NOW]:
            _sync(c, x, o, Hr)
        Hr += _issue(c, x, o, d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_kind[i], p, M)
    end = Hx
    if x.hwf[COMMIT_GPU] or moving:                     # the read-back's start and the launch's inputs
        G = pmax(G, Hx) + x.hwf[COMMIT_GPU] + (x.hwf[COMMIT_GPU_COPY] if moving else 0.0)
        end = pmax(Hx, G)
    if end > t_in:
        _span(c, o, x, p, dl, 0, OP_ROUTE, -1, t_in, end, 0, -1, -1)
    if x.hwf[WAVE]:
        _, G = _waves(c, x, o, d, p, m, dl, g0, g1, l0, l0, Hx, G, n, slow, M, False, False, x.hwf[OWA_GPU], 0.0)
    else:                                               # as _gpu_experts: no loads of its own (l0, l0)
        _, G = _kernels(c, x, o, d, p, m, dl, g0, g1, l0, l0, Hx, G, n, slow, M, x.hwi[FIFO])
    return Hr, G


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")
def _start_copy(c, x, t):
    """`Simulation._start_copy`: the start-up's wait beside a load moving at `t`."""
    if x.hwf[START_COPY] > 0.0 and c.I[IN_FLIGHT] and copying(c, x, t):
        return x.hwf[START_COPY]
    return 0.0


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")
def _begin(c, x, o, d, p, j0, H, G, M, chained):
    """`Simulation._begin_pass`: every copy landed, the pass's start-up, its first sync (commit),
    the policy's loads for the pass; a `chained` pass waits for nothing. Returns (H, G, where
    layer 0's span starts)."""
    if c.I[IN_FLIGHT] and not chained:              # the device is synchronised between passes
        c.I[DRAINED] = 1
        _advance(c, x, o, W_DRAINED, 0)
    if not chained:
        H = pmax(pmax(H, G), c.F[NOW])
    _sync(c, x, o, H)
    c.I[PASS_INDEX] = p
    if chained:
        last = pmax(G, H + x.hwf[CHAINED_GAP])      # the first mark lands when the GPU gets to it
    else:
        last = H + x.hwf[PASS_GAP]                  # the pass's first mark, past the gap
    if x.hwf[STARTUP_AFTER]:                        # its host launches the start-up at its end
        H2 = H + x.hwf[HOST_PASS_START]
        t = pmax(G, H2)
        G = t + x.hwf[PASS_START] + _start_copy(c, x, t)
    else:                                           # slower after a long pass, or one whose last wait was long
        H2 = H + (x.hwf[HOST_PASS_START] + (_flat(x.pass_wake, o.pass_us[p - 1]) + _flat(x.boundary_wake, c.F[LAST_WAIT])
                                            if p > 0 and x.decode[p - 1] else 0.0))
        t = pmax(G, H)                              # `Simulation._op`'s order: t + (its whole gpu cost)
        G = pmax(t + (x.hwf[PASS_START] + _start_copy(c, x, t)), H2)
    H, c.F[LAST_WAIT] = H2, 0.0
    if x.commit_decode[p]:
        H = pmax(H, G) + x.hwf[HOST_SYNC] + x.hwf[COMMIT_START]
        _sync(c, x, o, H)
    for i in range(d.l_ptr[j0], d.l_ptr[j0 + 1]):
        _sync(c, x, o, H)
        H += _issue(c, x, o, d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_kind[i], p, M)
    return H, G, last


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")
def _kernels(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, n, slow, M, fifo):
    """`Simulation._gpu_experts`: the GPU experts one kernel each, as their copies land; with one
    FIFO copy stream the loads deferred behind an expert are issued after its kernel."""
    for g in range(g0, g1):
        e, slot = d.g_e[g], d.g_slot[g]
        due = pmax(G, H)
        waited, landed = _await_copy(c, x, o, m, e, due)
        wait = pmax(0.0, landed - due) if waited else 0.0
        _ran(o, p, _own(d, l0, l1, m, e), wait)
        start = due + wait
        rows = n if x.all_rows[p] else _votes(x, p, m, e, M)
        issue = 0.0 if x.hwi[SILENT] else x.htab[rows]
        dur = x.xtab[x.xcls[m, e], rows]
        if c.I[IN_FLIGHT] and copying(c, x, start):
            dur *= slow
        G = pmax(start + dur, H + issue - x.hwf[TAIL])
        H += issue
        _span(c, o, x, p, dl, 0, OP_EXPERT, e, start, G, x.ebytes[m, e], m, slot)
        c.sfree[m, slot] = pmax(c.sfree[m, slot], G)
        if fifo:
            for i in range(l0, l1):
                if _deferred(d, g0, g1, i, m, fifo) and d.l_victim[i] == e:
                    _sync(c, x, o, H)
                    H += _issue(c, x, o, d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_kind[i], p, M)
        else:
            c.spend[m, slot] -= not _own(d, l0, l1, m, e)
            _release(c, x, m, slot)
    return H, G


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")
def _cpu(c, x, o, d, p, m, dl, c0, c1, H, G, M, cpu):
    """`Simulation._cpu_experts`: the host sets the fallbacks up, runs them, sends the results back
    (the GPU waits for them: a stall) and adds them in."""
    half = x.half_rt[p]
    cpu_t = H + x.hwf[CPU_LEAD]
    for k in range(c0, c1):
        if k > c0:
            cpu_t += x.hwf[CPU_GAP]
        e = d.c_e[k]
        rows = _votes(x, p, m, e, M)
        dur = x.ctab[x.xcls[m, e], rows] + _flat(x.cpu_wake, cpu_t - c.F[CPU_END])   # longer after the CPU idled (`cpu_wake_us`)
        _span(c, o, x, p, dl, cpu, OP_CPU, e, cpu_t, cpu_t + dur, x.ebytes[m, e], -1, -1)
        cpu_t += dur
        c.F[CPU_END] = cpu_t
    _span(c, o, x, p, dl, cpu, OP_RT, -1, cpu_t, cpu_t + half, 0, -1, -1)
    H = cpu_t + half
    if H > G:                                       # the GPU waits for the CPU's results
        o.stall[p] += H - G
        G = H
    return H + x.hwf[CPU_TAIL], G


@njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True, _nrt=False, inline="always")
def _layer(c, x, o, d, p, m, dl, j, H, G, t_in, n, slow, M, fifo, cpu):
    """`Simulation._moe_layer` once its router has run: commit's ahead path, or the read-back,
    the loads, the GPU experts (fused launches or one kernel each) and the CPU fallbacks."""
    g0, g1, c0, c1, l0, l1 = d.g_ptr[j], d.g_ptr[j + 1], d.c_ptr[j], d.c_ptr[j + 1], d.l_ptr[j], d.l_ptr[j + 1]
    o.fallbacks[p] += c1 - c0
    o.skipped[p] += d.skipped[j]
    if x.hwi[AHEAD] and x.commit_decode[p]:         # Simulation._ahead_layer
        return _ahead(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, t_in, n, slow, M)
    if not x.hwi[SILENT]:                           # the route step, slower after a long wait and beside a load
        moving = x.hwf[RB_COPY] != 0.0 and c.I[IN_FLIGHT] != 0 and copying(c, x, t_in)
        c.F[LAST_WAIT] = pmax(G - H, 0.0)
        H = pmax(H, G) + x.route_host[p] + _wake_extra(x, p, c.F[LAST_WAIT]) + (x.hwf[RB_COPY] if moving else 0.0)
    if not fifo:                                    # reads of resident experts; a loaded one is read after its write
        for g in range(g0, g1):
            if not _own(d, l0, l1, m, d.g_e[g]):
                c.spend[m, d.g_slot[g]] += 1
    for i in range(l0, l1):
        if _deferred(d, g0, g1, i, m, fifo):
            continue
        H += x.hwf[HOST_LOAD]                       # the load's host cost comes before its copy
        if H > c.F[NOW]:
            _sync(c, x, o, H)
        H += _issue(c, x, o, d.l_layer[i], d.l_e[i], d.l_slot[i], d.l_kind[i], p, M, True)
    if c1 > c0:                                     # the hidden states go to the host first
        _span(c, o, x, p, dl, cpu, OP_RT, -1, H, H + x.half_rt[p], 0, -1, -1)
        H += x.half_rt[p]
    if H > t_in:
        _span(c, o, x, p, dl, 0, OP_ROUTE, -1, t_in, H, 0, -1, -1)
    if x.hwf[WAVE]:
        H, G = _waves(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, n, slow, M, x.hwi[SILENT], True, 0.0,
                      0.0 if x.hwi[SILENT] else x.hwf[LAUNCH_COPY])
    else:
        H, G = _kernels(c, x, o, d, p, m, dl, g0, g1, l0, l1, H, G, n, slow, M, fifo)
    if c1 > c0:
        H, G = _cpu(c, x, o, d, p, m, dl, c0, c1, H, G, M, cpu)
    return H, G


@njit(cache=True, _nrt=False)
def run(c, x, o, d, p0, p1, M):
    """Passes [p0, p1) with their decisions in `d` (step 0 of a pass: begin_pass; 1 + m: layer m)."""
    H, G, prev_end = c.F[H_], c.F[G_], c.F[PREV_END]
    slow = x.hwf[SLOW]
    fifo = x.hwi[FIFO]
    cpu = 1 + x.hwi[ENGINES]                            # the CPU's stream code
    for p in range(p0, p1):
        j0 = (p - p0) * (M + 1)
        n = x.ntok[p]
        chained = p > 0 and x.queued[p - 1] and x.queued[p]
        H, G, last = _begin(c, x, o, d, p, j0, H, G, M, chained)
        prev_layer = -1
        for m in range(M):
            dl = x.moe_layers[m]
            for dense in range(prev_layer + 1, dl):
                H2 = H + x.dense_host[p]
                G = pmax(pmax(G, H) + x.dense_gpu[p], H2)
                H = H2
                _span(c, o, x, p, dense, 0, OP_DENSE, -1, last, G, 0, -1, -1)
                last = G
            prev_layer = dl
            gpu, host = x.attn_gpu[p], x.attn_host[p]
            if c.I[IN_FLIGHT] and copying(c, x, pmax(G, H)):
                gpu *= x.hwf[ATTN_SLOW]
            G = pmax(pmax(G, H) + gpu, H + host)
            H += host
            _span(c, o, x, p, dl, 0, OP_ATTN, -1, last, G, 0, -1, -1)
            H, G = _layer(c, x, o, d, p, m, dl, j0 + 1 + m, H, G, G, n, slow, M, fifo, cpu)
            last = pmax(G, H)
        H2 = H + x.hwf[HOST_HEAD]
        G = pmax(pmax(G, H) + x.hwf[HEAD], H2)
        H = H2
        if x.hwi[HEAD_SPAN]:
            _span(c, o, x, p, -1, 0, OP_HEAD, -1, last, G, 0, -1, -1)
        if x.queued[p]:                                 # the host waits for the pass before (its books)
            H = pmax(H, prev_end)
        else:                                           # the host waits for the logits
            H = pmax(H, G)
        _sync(c, x, o, H)
        o.pass_us[p] = G - prev_end
        prev_end = G
        if c.I[ERR]:
            break
    c.F[H_], c.F[G_], c.F[PREV_END] = H, G, prev_end
