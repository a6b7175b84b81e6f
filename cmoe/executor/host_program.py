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
runtime's own entry points, called as C functions (numba calls ctypes function pointers
directly), and the plan by the policy's compiled twin (`cmoe.sim.replay.decide`), which the
replay simulator already runs and tests/test_replay.py holds to the Python classes decision for
decision. So the executor and the simulator still make one set of decisions.

What the step records (marks, host times, which experts ran in which launch, the loads) goes into
arrays (`Books`); `cmoe.executor.lean_fast` turns them into the engine's spans and tallies at the
run's end, as the Python step's marks are read only then on CUDA too.

The functions a program calls (`Funcs`) are the CUDA runtime's on the GPU, and Python callbacks in
the CPU tests, which log every call: the order of calls is the thing the tests pin down.
"""

from __future__ import annotations

import ctypes
from collections import namedtuple

import numpy as np
from numba import njit

from cmoe.executor.host_live import live_begin, live_routes
from cmoe.executor.host_waves import _deferred, _index, _loads_now, _snapshot, _wave_of
from cmoe.sim.replay.decide import _begin, _plan
from cmoe.sim.replay.twin_pool import OCC

H2D, D2H = 1, 2
# Prog.gr columns: a MoE layer's graphs (0: none)
G_ATTN, G_EXPERTS, G_WAVE, G_FINISH = range(4)
# Prog.scal
S_PRE, S_HEAD, S_CS, S_CP, S_NBYTES, S_E, S_HOST0, S_K, S_COMMIT, S_LIVE, S_N = range(11)
# Books.lay_i columns (global mark ids) and Books.lay_f (host us)
L_TIN, L_TPLAN, L_LAST = range(3)
F_IN, F_SYNCED, F_ROUTED, F_LAST, F_RB = range(5)
# Books.cnt
C_MARKS, C_WAVES, C_WX, C_LOADS, C_SKIPPED, C_ERR, C_ERRCALL, C_BEGIN_LOADS = range(8)
# calls, for an error's message
CALLS = ("cudaGraphLaunch", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventSynchronize", "cudaMemcpyAsync",
         "out of timing events")

# What a program reads, made once a run (`lean_fast`): graphs' executable handles [M, 4] and scalars
# (pre, head, the two streams, an expert's bytes, E, the clock's zero in ns); the read-back per
# layer (pinned host address, device address, bytes, its event); the slot table's device row and
# the pinned staging rows [M, W, E] with their addresses [M, W]; each slot's device address [M, S];
# each expert's pinned host address [M, E].
# commit's besides (1-element dummies for the others): layer 0's prediction read back at the pass's
# start (as rb), each row's candidates [M, N, K] int32 and the committed set [M, E] bool in pinned
# staging with their copies' (device, pinned, bytes) [M, 3], each row's predictions [P, M, N, Kp].
# A live pass's besides (`host_live`; dummies for a replay): the pinned floats each layer's read-back
# lands in [M + 1, N * most columns] (rb's host addresses point into it; row M: commit's rb0), each
# layer's columns, prediction columns and where they start [M + 1, 3] (`host_live.layout`), and
# scratch for the ranking [2E + max(K, K2)]; commit's tp is then [1, M, N, K2], filled from the
# read-backs as they land.
Prog = namedtuple("Prog", ["gr", "scal", "rb", "table_dst", "stage", "stage_ptr", "slot_ptr", "src_ptr",
                           "rb0", "ids", "ids_ptr", "comm", "comm_ptr", "tp", "rbh", "lv", "scr"])
# The pool as the device holds it, kept across passes: what each slot holds, a copy no kernel has
# waited for yet, a slot some kernel read, and the events those wait on (the load's end mark, the
# last reading launch's end mark), and the global id of the pending copy's end mark.
Pool = namedtuple("Pool", ["expert", "pending", "was_read", "ready_ev", "read_ev", "landed"])
# One pass's records: per layer marks and host times; per launch (wave) its layer, marks, host
# times and its experts' range in wx; per expert that ran (expert, loaded by this layer's plan,
# landed mark or -1, due mark); per load (layer, expert, slot, start mark, end mark); counts; the
# event each mark of the pass was recorded on; per layer, after its step, what each slot of its
# block holds on the device and in the policy's index (the plan records' `physical`, `logical`).
Books = namedtuple("Books", ["lay_i", "lay_f", "wav_i", "wav_f", "wx", "ld", "cnt", "ev", "phys", "logi", "pass_f"])
Funcs = namedtuple("Funcs", ["launch", "record", "wait", "sync", "copy", "clock"])


def books(M: int, E: int, S: int, waves: int, marks: int) -> Books:
    """Record buffers for one pass: a layer launches at most `waves` times and runs at most E
    experts, loads at most 3E (its plan's, a look-ahead's prefetches), the pass's begin loads at
    most 3E more; S: the most slots of a block."""
    z = lambda *s: np.zeros(s, np.int64)
    return Books(z(M, 3), np.zeros((M, 5)), z(M * waves, 4), np.zeros((M * waves, 2)), z(M * E, 4),
                 z((M + 1) * 3 * E, 5), z(8), z(marks), z(M, S), z(M, S), np.zeros(2))


def no_commit(M: int) -> dict:
    """Prog's commit fields for a policy that commits nothing."""
    return {"rb0": np.zeros(4, np.int64), "ids": np.zeros((M, 1, 1), np.int32), "ids_ptr": np.zeros((M, 3), np.int64),
            "comm": np.zeros((M, 1), np.bool_), "comm_ptr": np.zeros((M, 3), np.int64),
            "tp": np.zeros((1, M, 1, 1), np.int16)}


def no_live(M: int) -> dict:
    """Prog's live fields for a replayed run (the trace's routes, not the read-back's, are planned)."""
    return {"rbh": np.zeros((M + 1, 1), np.float32), "lv": np.zeros((M + 1, 3), np.int64), "scr": np.zeros(1, np.int64)}


def program(f: Funcs):
    """The compiled pass over these functions (compile it before timing: `compile_for`; the
    functions are fixed into the machine code, so a program is built per process and set of
    functions). Returns `run(prog, pool, s, d, pd, b, gbase, p, P, ts, waves)`: 0, or the failing
    call's error (`Books.cnt`)."""
    pr = _prims(f)
    load = _loader(f, pr)
    layer = _layer(f, pr, *_layer_head(f, pr, load), _launcher(f, pr, load))
    import sys
    from cmoe.executor.host_commit import commit_parts
    start, committed = commit_parts(f, pr, load, sys.modules[__name__])
    launch, fail = f.launch, pr.fail

    @njit(_nrt=False)
    def run(prog, pool, s, d, pd, b, gbase, p, P, ts, waves):
        """The pass after its inputs: P's graph, the policy's begin loads, each MoE layer, H's graph."""
        b.cnt[:] = 0
        d.n[:] = 0
        cs = prog.scal[S_CS]
        rc = launch(prog.scal[S_PRE], cs)
        if rc:
            return fail(b, rc, 0)
        commit = prog.scal[S_COMMIT] != 0
        if commit and start(prog, b, ts):
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
            if committed(prog, pool, s, d, pd, b, gbase, p, P, m, ts) if commit else \
                    layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts, waves):
                return -1
        d.occupancy[0] = s.scal[OCC]
        j = d.n[3]
        d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
        rc = launch(prog.scal[S_HEAD], cs)
        if rc:
            return fail(b, rc, 0)
        return 0

    return run


def _layer(f: Funcs, pr: "Prims", enter, plan, wave):
    launch, mark, fail, now = f.launch, pr.mark, pr.fail, pr.now

    @njit(_nrt=False)
    def layer(prog, pool, s, d, pd, b, gbase, p, P, m, ts, waves):
        """MoE layer m: A_m's graph, then `_host_layer`'s calls in its order."""
        cs, host0 = prog.scal[S_CS], prog.scal[S_HOST0]
        t_in = enter(prog, b, gbase, m, ts)
        if t_in < 0:
            return -1
        g0, g1, l0, l1, nw = plan(prog, pool, s, d, pd, b, gbase, p, P, m, waves)
        if nw < 0:
            return -1
        b.lay_f[m, F_ROUTED] = now(ts, host0)
        t_plan = mark(b, gbase, cs)
        if t_plan < 0:
            return -1
        launches = max(nw, 1)                             # no GPU expert: one launch that skips all
        t1 = t_plan
        for k in range(launches):                         # `_launch_waves`
            t1 = wave(prog, pool, d, b, gbase, m, k, g0, g1, l0, l1, nw, waves, t1, launches == 1, ts)
            if t1 < 0:
                return -1
        if launches > 1:
            rc = launch(prog.gr[m, G_FINISH], cs)
            if rc:
                return fail(b, rc, 0)
            t1 = mark(b, gbase, cs)
            if t1 < 0:
                return -1
        b.lay_i[m, L_TIN], b.lay_i[m, L_TPLAN], b.lay_i[m, L_LAST] = t_in, t_plan, t1
        _snapshot(pool, s, b, m, prog.scal[S_E])
        b.lay_f[m, F_LAST] = now(ts, host0)
        return 0

    return layer


Prims = namedtuple("Prims", ["now", "fail", "mark", "evof"])


def _prims(f: Funcs) -> Prims:
    """The host clock (CLOCK_MONOTONIC: what time.perf_counter reads), an error kept once, and a
    timing mark: the pass's next event recorded on a stream, its global id (-1: failed)."""
    record, clock = f.record, f.clock

    @njit(_nrt=False)
    def now(ts, host0):
        clock(1, ts.ctypes.data)
        return (ts[0] * 1_000_000_000 + ts[1] - host0) / 1000.0

    @njit(_nrt=False)
    def fail(b, rc, call):
        if b.cnt[C_ERR] == 0:
            b.cnt[C_ERR], b.cnt[C_ERRCALL] = rc, call
        return rc

    @njit(_nrt=False)
    def mark(b, gbase, stream):
        k = b.cnt[C_MARKS]
        if k >= b.ev.size:
            fail(b, -1, 5)
            return -1
        rc = record(b.ev[k], stream)
        if rc:
            fail(b, rc, 1)
            return -1
        b.cnt[C_MARKS] = k + 1
        return gbase + k

    @njit(_nrt=False)
    def evof(b, gbase, g):
        return b.ev[g - gbase]

    return Prims(now, fail, mark, evof)


def _loader(f: Funcs, pr: Prims):
    wait, copy, mark, fail, evof = f.wait, f.copy, pr.mark, pr.fail, pr.evof

    @njit(_nrt=False)
    def load(prog, pool, b, gbase, m, e, slot):
        """`DevicePool.load` on the copy stream: wait for the slot's last reader, the copy between
        its two marks; the slot now holds e, its copy pending. 0, or the error."""
        cp = prog.scal[S_CP]
        if pool.was_read[m, slot]:
            rc = wait(cp, pool.read_ev[m, slot], 0)
            if rc:
                return fail(b, rc, 2)
        t0 = mark(b, gbase, cp)
        if t0 < 0:
            return -1
        rc = copy(prog.slot_ptr[m, slot], prog.src_ptr[m, e], prog.scal[S_NBYTES], H2D, cp)
        if rc:
            return fail(b, rc, 4)
        t1 = mark(b, gbase, cp)
        if t1 < 0:
            return -1
        pool.ready_ev[m, slot], pool.landed[m, slot] = evof(b, gbase, t1), t1
        pool.expert[m, slot], pool.pending[m, slot] = e, True
        i = b.cnt[C_LOADS]
        b.ld[i, 0], b.ld[i, 1], b.ld[i, 2], b.ld[i, 3], b.ld[i, 4] = m, e, slot, t0, t1
        b.cnt[C_LOADS] = i + 1
        return 0

    return load


def _layer_head(f: Funcs, pr: Prims, load):
    """A layer's step up to its launches: `_enter_layer` and the read-back (`enter`), then the
    policy's plan by its twin and the loads not deferred behind a launch (`plan`)."""
    launch, record, sync, copy, now, mark, fail = f.launch, f.record, f.sync, f.copy, pr.now, pr.mark, pr.fail

    @njit(_nrt=False)
    def enter(prog, b, gbase, m, ts):
        cs, host0 = prog.scal[S_CS], prog.scal[S_HOST0]
        rc = launch(prog.gr[m, G_ATTN], cs)
        if rc:
            return fail(b, rc, 0)
        b.lay_f[m, F_IN] = now(ts, host0)
        t_in = mark(b, gbase, cs)
        if t_in < 0:
            return -1
        rc = copy(prog.rb[m, 0], prog.rb[m, 1], prog.rb[m, 2], D2H, cs)
        if rc:
            return fail(b, rc, 4)
        rc = record(prog.rb[m, 3], cs)
        if rc:
            return fail(b, rc, 1)
        rc = sync(prog.rb[m, 3])
        if rc:
            return fail(b, rc, 3)
        b.lay_f[m, F_SYNCED] = now(ts, host0)
        return t_in

    @njit(_nrt=False)
    def plan(prog, pool, s, d, pd, b, gbase, p, P, m, waves):
        """Step 1 + m of the twin's decisions: (GPU experts' range, loads' range, waves); waves -1: failed."""
        j = 1 + m
        g0, l0 = d.n[0], d.n[2]
        d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
        d.skipped[j] = 0
        if prog.scal[S_LIVE]:                             # the read-back's routes (pass 0 of the live arrays)
            live_routes(prog.rbh, prog.lv, prog.scal[S_N], prog.scal[S_E], prog.scal[S_K], prog.scr, pd, prog.tp, m, False)
        _plan(s, d, p, m, P, pd, s.protect, s.hits, s.placed)
        d.n[3] = j + 1
        g1, l1 = d.n[0], d.n[2]
        b.cnt[C_SKIPPED] += d.skipped[j]
        nw = _wave_of(d, g0, g1, l0, l1, m, waves)
        for i in range(l0, l1):
            if not _deferred(d, i, m, g0, g1):
                if load(prog, pool, b, gbase, d.l_layer[i], d.l_e[i], d.l_slot[i]):
                    return g0, g1, l0, l1, -1
        return g0, g1, l0, l1, nw

    return enter, plan


def _launcher(f: Funcs, pr: Prims, load):
    launch, wait, copy, now, mark, fail, evof = f.launch, f.wait, f.copy, pr.now, pr.mark, pr.fail, pr.evof

    @njit(_nrt=False)
    def wave(prog, pool, d, b, gbase, m, k, g0, g1, l0, l1, nw, waves, due, one, ts):
        """Launch k of layer m (`_launch_waves`' loop body): its table row, the waits on its slots'
        copies, the launch between two marks, its reads, the loads that waited for them. Returns
        its end mark (the next launch's due), or -1."""
        cs = prog.scal[S_CS]
        h0 = now(ts, prog.scal[S_HOST0])
        row = prog.stage[m, k]
        row[:] = -1
        for i in range(g0, g1):
            if waves[i - g0] == k:
                row[d.g_e[i]] = d.g_slot[i]
        rc = copy(prog.table_dst[m], prog.stage_ptr[m, k], prog.scal[S_E] * 4, H2D, cs)
        if rc:
            return fail(b, rc, 4)
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
            if pool.pending[m, sl]:                        # `DevicePool.before_read`
                rc = wait(cs, pool.ready_ev[m, sl], 0)
                if rc:
                    return fail(b, rc, 2)
                pool.pending[m, sl] = False
        t0 = mark(b, gbase, cs)
        if t0 < 0:
            return -1
        rc = launch(prog.gr[m, G_EXPERTS] if one else prog.gr[m, G_WAVE], cs)
        if rc:
            return fail(b, rc, 0)
        t1 = mark(b, gbase, cs)
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
        b.wav_f[w, 0], b.wav_f[w, 1] = h0, now(ts, prog.scal[S_HOST0])
        b.cnt[C_WAVES] = w + 1
        return t1

    return wave


def compile_for(run, *args) -> None:
    """Compile `run` for these arguments' types without running it (before timing)."""
    import numba
    run.compile(tuple(numba.typeof(a) for a in args))


def runtime_funcs(lib) -> Funcs:
    """The CUDA runtime's entry points (the library torch loaded, `cuda_rt.Runtime`) and libc's
    clock_gettime, typed with plain integers for handles (the same registers as pointers)."""
    u64, i32, u32 = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint

    def fn(f, *args):
        g = ctypes.CFUNCTYPE(i32, *args)(ctypes.cast(f, ctypes.c_void_p).value)
        return g
    libc = ctypes.CDLL(None)
    return Funcs(fn(lib.cudaGraphLaunch, u64, u64), fn(lib.cudaEventRecord, u64, u64),
                 fn(lib.cudaStreamWaitEvent, u64, u64, u32), fn(lib.cudaEventSynchronize, u64),
                 fn(lib.cudaMemcpyAsync, u64, u64, ctypes.c_size_t, i32, u64), fn(libc.clock_gettime, i32, u64))


def perf_counter_is_monotonic() -> bool:
    """The host times the program takes (CLOCK_MONOTONIC) are the engine's (`time.perf_counter`)."""
    import time
    return time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
