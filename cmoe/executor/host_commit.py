"""`commit`'s decode step in the compiled host program (`cmoe.executor.host_program`), in the order
of the Python step it stands for: the pass's start (`lean_io.HostIO._pred0_host`: the layer-0
prediction read back before the begin loads) and each layer (`lean_steps.HostSteps._commit_layer`:
the read-back queued, each row's committed candidates, the committed set and the slot table
written, the waits, the launch, and only then the wait for the read-back, the plan, whose loads
are the next layer's). The candidates are each row's predictions (`Prog.tp`): the trace's in a
replay, as the Python step reads them; in a live run the read-backs', ranked as they land
(`host_live`: layer 0's at the pass's start, layer m + 1's after layer m's read-back)."""

from __future__ import annotations

from numba import njit

from cmoe.executor.host_prims import (C_WAVES, C_WX, F_RB, F_ROUTED, F_SYNCED, G_EXPERTS, S_CS, S_E, S_K, before_read,
                                      copy_in, evof, fail, launch_ok, layer_done, layer_entry, load, mark, now,
                                      read_back, sync_ok, twin_step)
from cmoe.sim.replay.twin_pool import _among


@njit(cache=True, _nrt=False)
def commit_start(prog, b, ts):
    """The pass's start (`_pred0_host`): layer 0's prediction read back, its wait."""
    cs = prog.scal[S_CS]
    b.pass_f[0] = now(prog, ts)
    if read_back(prog, b, prog.rb0, cs) or sync_ok(prog, b, prog.rb0[3]):
        return -1
    b.pass_f[1] = now(prog, ts)
    return 0


@njit(cache=True, _nrt=False)
def committed_layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts):
    """commit's MoE layer m in decode: `_head`, `_launched`, `_tail`; 0, or -1 (the error in `Books.cnt`)."""
    t_in = _head(prog, s, b, gbase, p, m, ts)
    if t_in < 0:
        return -1
    t_plan, t1 = _launched(prog, pool, s, b, gbase, m, ts)
    if t1 < 0 or _tail(prog, pool, s, d, pd, b, gbase, p, P, m, ts):
        return -1
    return layer_done(prog, pool, s, b, m, t_in, t_plan, t1, ts)


@njit(cache=True, _nrt=False)
def _head(prog, s, b, gbase, p, m, ts):
    """A layer up to its launch: A_m, its read-back queued, the candidates, the committed set and
    the table row written and copied in. The layer's entry mark, or -1."""
    cs = prog.scal[S_CS]
    t_in = layer_entry(prog, b, gbase, m, ts)
    if t_in < 0:
        return -1
    _inputs(prog, s, p, m, prog.scal[S_K])
    if read_back(prog, b, prog.rb[m], cs) or \
            copy_in(prog, b, prog.ids_ptr[m, 0], prog.ids_ptr[m, 1], prog.ids_ptr[m, 2], cs) or \
            copy_in(prog, b, prog.comm_ptr[m, 0], prog.comm_ptr[m, 1], prog.comm_ptr[m, 2], cs) or \
            copy_in(prog, b, prog.table_dst[m], prog.stage_ptr[m, 0], prog.scal[S_E] * 4, cs):
        return -1
    return t_in


@njit(cache=True, _nrt=False)
def _launched(prog, pool, s, b, gbase, m, ts):
    """The plan's mark, the waits on the committed slots' copies, the launch and its reads:
    (plan mark, end mark), the end -1 if a call failed."""
    cs, n = prog.scal[S_CS], s.ncommitted[m]
    t_plan = mark(prog, b, gbase, cs)
    h0 = now(prog, ts)
    w, x0 = b.cnt[C_WAVES], b.cnt[C_WX]
    waited = False
    for e in s.committed[m, :n]:
        sl = s.slot[m, e]
        if pool.expert[m, sl] != e:
            return t_plan, fail(b, -2, 5)
        x = b.cnt[C_WX]
        b.wx[x, 0], b.wx[x, 1], b.wx[x, 2], b.wx[x, 3] = e, 0, pool.landed[m, sl] if pool.pending[m, sl] else -1, t_plan
        b.cnt[C_WX] = x + 1
        got = before_read(prog, pool, b, m, sl, cs)
        if got < 0:
            return t_plan, -1
        waited = waited or got == 1
    t0 = mark(prog, b, gbase, cs) if waited else t_plan
    if launch_ok(prog, b, prog.gr[m, G_EXPERTS], cs):
        return t_plan, -1
    t1 = mark(prog, b, gbase, cs)
    if t_plan < 0 or t0 < 0 or t1 < 0:
        return t_plan, -1
    for e in s.committed[m, :n]:
        pool.read_ev[m, s.slot[m, e]], pool.was_read[m, s.slot[m, e]] = evof(b, gbase, t1), True
    b.wav_i[w, 0], b.wav_i[w, 1], b.wav_i[w, 2], b.wav_i[w, 3] = m, t0, t1, x0
    b.wav_f[w, 0], b.wav_f[w, 1] = h0, now(prog, ts)
    b.cnt[C_WAVES] = w + 1
    return t_plan, t1


@njit(cache=True, _nrt=False)
def _tail(prog, pool, s, d, pd, b, gbase, p, P, m, ts):
    """While the experts run: the wait for the read-back, the plan (its GPU set must be the
    committed one), its loads (the next layer's). 0, or -1 (failed)."""
    n = s.ncommitted[m]
    b.lay_f[m, F_RB] = now(prog, ts)
    if sync_ok(prog, b, prog.rb[m, 3]):
        return -1
    b.lay_f[m, F_SYNCED] = now(prog, ts)
    g0, l0 = twin_step(prog, s, d, pd, b, p, P, m)
    if d.n[0] - g0 != n:
        return fail(b, -2, 5)
    for i in range(n):
        if d.g_e[g0 + i] != s.committed[m, i]:
            return fail(b, -2, 5)
    for i in range(l0, d.n[2]):
        if load(prog, pool, b, gbase, d.l_layer[i], d.l_e[i], d.l_slot[i]):
            return -1
    b.lay_f[m, F_ROUTED] = now(prog, ts)
    return 0


@njit(cache=True, _nrt=False)
def _inputs(prog, s, p, m, K):
    """Each row's predicted experts that were committed (first time each, up to K), the committed
    set, the slot table's row: written into their pinned staging."""
    n = s.ncommitted[m]
    ids, tp = prog.ids[m], prog.tp[p, m]
    ids[:] = -1
    for i in range(ids.shape[0]):
        c = 0
        for q in range(tp.shape[1]):
            e = tp[i, q]
            if e < 0 or c >= K or not _among(e, s.committed[m, :n]) or _among(e, tp[i, :q]):
                continue
            ids[i, c] = e
            c += 1
    prog.comm[m, :] = False
    row = prog.stage[m, 0]
    row[:] = -1
    for e in s.committed[m, :n]:
        prog.comm[m, e] = True
        row[e] = s.slot[m, e]
