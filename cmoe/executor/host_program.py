"""A graphed decode pass's host side as one compiled call (issue 13): the lean engine's step for
every MoE layer (`lean_steps.HostSteps._host_layer`: the read-back, the policy's plan, the loads,
the slot table, the waits and the launches), done for the whole pass by machine code instead of
~100-180 us of Python a layer.

Why: on the lent H200's host the loading policies' step took 89-184 us a MoE layer (BENCHMARKS.md,
twentieth session) where its CUDA calls are ~10 runtime calls of ~1 us; the rest is CPython
running a few hundred lines cold after each read-back wait (the policy's `plan` took 3.95 us in a
tight loop and 15-18 us inside the step). Shaving single calls moved it little in twenty
sessions. Here the same calls, in the same order, are made from numba-compiled code: the graphs
by `cudaGraphLaunch` on their executable handles, copies, event records and waits through the
runtime's own entry points, called as C functions through their addresses (`host_calls`: so the
program is the same machine code in every process, and numba's cache keeps it), and the plan by
the policy's compiled twin (`cmoe.sim.replay.decide`), which the replay simulator already runs and
tests/test_replay.py holds to the Python classes decision for decision. So the executor and the
simulator still make one set of decisions.

What the step records (marks, host times, which experts ran in which launch, the loads) goes into
arrays (`Books`); `cmoe.executor.lean_fast` turns them into the engine's spans and tallies at the
run's end, as the Python step's marks are read only then on CUDA too.

The program runs without the GIL (`nogil`): it waits on read-backs for milliseconds, and until the
thirty-sixth session it held the GIL through them, so any other Python thread of the process (the
validation's host-load sampler, a user's server thread) was frozen for a whole pass and then ran
at the next pass's start, where the GPU waits for the host (BENCHMARKS.md, thirty-sixth session:
782 of 871 long LM-head steps held a sample's time). A callback into Python (the CPU experts'
step, the tests' logging stand-ins) takes the GIL back through ctypes for its own run.

The functions a program calls (`Prog.fn`) are the CUDA runtime's on the GPU, and Python callbacks in
the CPU tests, which log every call: the order of calls is the thing the tests pin down. The layout
of its inputs and records and its primitives are `host_prims`'; commit's own order `host_commit`.
"""

from __future__ import annotations

from numba import njit

from cmoe.executor.host_commit import commit_start, committed_layer
from cmoe.executor.host_live import live_begin
from cmoe.executor.host_prims import (C_BEGIN_LOADS, C_LOADS, C_WAVES, C_WX, F_ROUTED, F_SYNCED, G_EXPERTS,
                                      G_FEW_EXPERTS, G_FEW_WAVE, G_FINISH, G_WAVE, S_COMMIT, S_CS, S_E, S_FEW,
                                      S_HEAD, S_LIVE, S_N, S_PRE, before_read, copy_in,
                                      cpu_ok, evof, fail, launch_ok, layer_done, layer_entry, load, mark, now, read_back,
                                      sync_ok, twin_step)
# what the engine reads as hp.X (`lean_fast`): the layout, the runtime's addresses
from cmoe.executor.host_calls import address, cpu_callback, runtime_addresses  # noqa: F401
from cmoe.executor.host_prims import (CALLS, C_ERR, C_ERRCALL, C_MARKS, C_SKIPPED, F_LAST, L_LAST, L_TIN, L_TPLAN,  # noqa: F401
                                      Pool, Prog, books, no_commit, no_live, pool_of)
from cmoe.executor.host_waves import _deferred, _index, _loads_now, _wave_of
from cmoe.sim.replay.decide import _begin
from cmoe.sim.replay.twin_pool import OCC


@njit(cache=True, _nrt=False, nogil=True)
def run(prog, pool, s, d, pd, b, gbase, p, P, ts, waves):
    """The pass after its inputs: P's graph, the policy's begin loads, each MoE layer, H's graph.
    0, or -1: the failing call and its error in `Books.cnt`."""
    b.cnt[:] = 0
    d.n[:] = 0
    cs = prog.scal[S_CS]
    if launch_ok(prog, b, prog.scal[S_PRE], cs):
        return -1
    commit = prog.scal[S_COMMIT] != 0
    if commit and commit_start(prog, b, ts):
        return -1
    if prog.scal[S_LIVE]:                             # a live pass: its arrays start empty
        live_begin(prog.rbh, prog.lv, prog.scal[S_N], prog.scal[S_E], prog.scr, pd, prog.tp, commit)
    d.g_ptr[0], d.c_ptr[0], d.l_ptr[0] = 0, 0, 0      # step 0: begin_pass
    d.skipped[0] = 0
    _begin(s, d, p, P, pd, s.protect, s.placed)
    d.n[3] = 1
    for i in range(d.n[2]):
        if load(prog, pool, b, gbase, d.l_layer[i], d.l_e[i], d.l_slot[i]):
            return -1
    b.cnt[C_BEGIN_LOADS] = b.cnt[C_LOADS]
    for m in range(pd.M):
        if committed_layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts) if commit else \
                _layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts, waves):
            return -1
    d.occupancy[0] = s.scal[OCC]
    j = d.n[3]
    d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
    return launch_ok(prog, b, prog.scal[S_HEAD], cs)


@njit(cache=True, _nrt=False)
def _layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts, waves):
    """MoE layer m: A_m's graph, then `_host_layer`'s calls in its order. A layer with CPU experts
    hands the engine its input before the launches (`cpu` phase 0) and its CPU experts' sum after
    them (phase 1), and always launches in waves: their fp32 sum takes the CPU's before the finish."""
    cs = prog.scal[S_CS]
    t_in = _enter(prog, b, gbase, m, ts)
    if t_in < 0:
        return -1
    g0, g1, l0, l1, nw = _plan_step(prog, pool, s, d, pd, b, gbase, p, P, m, waves)
    if nw < 0:
        return -1
    on_cpu = d.n[1] > d.c_ptr[1 + m]                  # the twin's step 1 + m named CPU experts
    if on_cpu and cpu_ok(prog, b, m, 0):
        return -1
    b.lay_f[m, F_ROUTED] = now(prog, ts)
    t_plan = mark(prog, b, gbase, cs)
    if t_plan < 0:
        return -1
    launches = max(nw, 1)                             # no GPU expert: one launch that skips all
    t1 = t_plan
    for k in range(launches):                         # `_launch_waves`
        t1 = _wave(prog, pool, d, b, gbase, m, k, g0, g1, l0, l1, nw, waves, t1, launches == 1 and not on_cpu, ts)
        if t1 < 0:
            return -1
    if on_cpu and cpu_ok(prog, b, m, 1):
        return -1
    if launches > 1 or on_cpu:
        if launch_ok(prog, b, prog.gr[m, G_FINISH], cs):
            return -1
        t1 = mark(prog, b, gbase, cs)
        if t1 < 0:
            return -1
    return layer_done(prog, pool, s, b, m, t_in, t_plan, t1, ts)


@njit(cache=True, _nrt=False)
def _enter(prog, b, gbase, m, ts):
    cs = prog.scal[S_CS]
    t_in = layer_entry(prog, b, gbase, m, ts)
    if t_in < 0:
        return -1
    if read_back(prog, b, prog.rb[m], cs) or sync_ok(prog, b, prog.rb[m, 3]):
        return -1
    b.lay_f[m, F_SYNCED] = now(prog, ts)
    return t_in


@njit(cache=True, _nrt=False)
def _plan_step(prog, pool, s, d, pd, b, gbase, p, P, m, waves):
    """The twin's step 1 + m and its loads not deferred behind a launch: (GPU experts' range, loads'
    range, waves); waves -1: failed."""
    g0, l0 = twin_step(prog, s, d, pd, b, p, P, m)
    g1, l1 = d.n[0], d.n[2]
    nw = _wave_of(d, g0, g1, l0, l1, m, waves)
    for i in range(l0, l1):
        if not _deferred(d, i, m, g0, g1):
            if load(prog, pool, b, gbase, d.l_layer[i], d.l_e[i], d.l_slot[i]):
                return g0, g1, l0, l1, -1
    return g0, g1, l0, l1, nw


@njit(cache=True, _nrt=False)
def _graph(prog, m, one, n):
    """The graph a launch of n experts replays: the layer's whole-step or wave graph, or its
    few-expert twin where n is at most scal[S_FEW] and the twin was captured."""
    col = G_EXPERTS if one else G_WAVE
    if 0 < n <= prog.scal[S_FEW]:
        few = prog.gr[m, G_FEW_EXPERTS if one else G_FEW_WAVE]
        if few != 0:
            return few
    return prog.gr[m, col]


@njit(cache=True, _nrt=False)
def _wave(prog, pool, d, b, gbase, m, k, g0, g1, l0, l1, nw, waves, due, one, ts):
    """Launch k of layer m (`_launch_waves`' loop body): its table row, the waits on its slots'
    copies, the launch between two marks, its reads, the loads that waited for them. Returns
    its end mark (the next launch's due), or -1."""
    cs = prog.scal[S_CS]
    h0 = now(prog, ts)
    row = prog.stage[m, k]
    row[:] = -1
    for i in range(g0, g1):
        if waves[i - g0] == k:
            row[d.g_e[i]] = d.g_slot[i]
    if copy_in(prog, b, prog.table_dst[m], prog.stage_ptr[m, k], prog.scal[S_E] * 4, cs):
        return -1
    w, x0 = b.cnt[C_WAVES], b.cnt[C_WX]
    for i in range(g0, g1):
        if waves[i - g0] != k:
            continue
        e, sl = d.g_e[i], d.g_slot[i]
        if pool.expert[m, sl] != e:
            return fail(b, -2, 5)                      # the plan and the pool disagree
        x = b.cnt[C_WX]
        b.wx[x, 0], b.wx[x, 1], b.wx[x, 3] = e, _loads_now(d, l0, l1, m, e), due
        b.wx[x, 2] = pool.landed[m, sl] if pool.pending[m, sl] else -1
        b.cnt[C_WX] = x + 1
        if before_read(prog, pool, b, m, sl, cs) < 0:
            return -1
    t0 = mark(prog, b, gbase, cs)
    if t0 < 0:
        return -1
    if launch_ok(prog, b, _graph(prog, m, one, b.cnt[C_WX] - x0), cs):
        return -1
    t1 = mark(prog, b, gbase, cs)
    if t1 < 0:
        return -1
    for i in range(g0, g1):                            # `DevicePool.mark_read`
        if waves[i - g0] == k:
            pool.read_ev[m, d.g_slot[i]], pool.was_read[m, d.g_slot[i]] = evof(b, gbase, t1), True
    for i in range(l0, l1):                            # the loads that waited for this launch's reads
        if _deferred(d, i, m, g0, g1) and waves[_index(d.g_e, g0, g1, d.l_victim[i]) - g0] == k:
            if load(prog, pool, b, gbase, d.l_layer[i], d.l_e[i], d.l_slot[i]):
                return -1
    b.wav_i[w, 0], b.wav_i[w, 1], b.wav_i[w, 2], b.wav_i[w, 3] = m, t0, t1, x0
    b.wav_f[w, 0], b.wav_f[w, 1] = h0, now(prog, ts)
    b.cnt[C_WAVES] = w + 1
    return t1


def compile_for(fn, *args):
    """Compile `fn` (`run`) for these arguments' types without running it, before timing (from
    numba's cache where an earlier process compiled it), and return the compiled entry point. A
    pass calls that, not `fn`: the dispatcher types all 81 arrays of the arguments again on every
    call (8.7 us a call on 2026-12-05's AMD CPU, 0.7 through the entry point:
    `benchmarks/program_call.py`), at the pass boundary, where the GPU waits. The entry point does
    not check types, so a caller passes it these same objects (or ones of the same types) only."""
    import numba
    return fn.compile(tuple(numba.typeof(a) for a in args))


def perf_counter_is_monotonic() -> bool:
    """The host times the program takes (CLOCK_MONOTONIC) are the engine's (`time.perf_counter`)."""
    import time
    return time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
