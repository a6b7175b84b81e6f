"""What the compiled host program's parts share (`cmoe.executor.host_program`, `host_commit`): the
layout of its inputs and records (`Prog`, `Pool`, `Books` and their column names), and its
primitives: the host clock, an error kept once, a timing mark, each runtime call checked, a load on
the copy stream, a layer's entry, end and twin step."""

from __future__ import annotations

import cmoe.sim.replay  # noqa: F401,E402  (first: it sets numba's cache folder, `cmoe.sim.replay`)

from collections import namedtuple

import numpy as np
from numba import njit

from cmoe.executor.host_calls import clock, copy, cpu, launch, record, sync, wait
from cmoe.executor.host_live import live_routes
from cmoe.executor.host_waves import _snapshot
from cmoe.sim.replay.decide import _plan

H2D, D2H = 1, 2
# Prog.gr columns: a MoE layer's graphs (0: none); the FEW ones run the few-expert kernel
# configuration, for a launch naming at most scal[S_FEW] experts (`cmoe.executor.few_experts`)
G_ATTN, G_EXPERTS, G_WAVE, G_FINISH, G_FEW_EXPERTS, G_FEW_WAVE = range(6)
# Prog.scal
S_PRE, S_HEAD, S_CS, S_CP, S_NBYTES, S_E, S_HOST0, S_K, S_COMMIT, S_LIVE, S_N, S_FEW = range(12)
# Books.lay_i columns (global mark ids) and Books.lay_f (host us)
L_TIN, L_TPLAN, L_LAST = range(3)
F_IN, F_SYNCED, F_ROUTED, F_LAST, F_RB = range(5)
# Books.cnt
C_MARKS, C_WAVES, C_WX, C_LOADS, C_SKIPPED, C_ERR, C_ERRCALL, C_BEGIN_LOADS = range(8)
# calls, for an error's message
CALLS = ("cudaGraphLaunch", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventSynchronize", "cudaMemcpyAsync",
         "out of timing events", "the CPU experts' step")

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
# read-backs as they land. Last, the C functions' addresses (`host_calls`: F_LAUNCH ..).
Prog = namedtuple("Prog", ["gr", "scal", "rb", "table_dst", "stage", "stage_ptr", "slot_ptr", "src_ptr",
                           "rb0", "ids", "ids_ptr", "comm", "comm_ptr", "tp", "rbh", "lv", "scr", "fn"])
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


def books(M: int, E: int, S: int, waves: int, marks: int) -> Books:
    """Record buffers for one pass: a layer launches at most `waves` times and runs at most E
    experts, loads at most 3E (its plan's, a look-ahead's prefetches), the pass's begin loads at
    most 3E more; S: the most slots of a block."""
    z = lambda *s: np.zeros(s, np.int64)
    return Books(z(M, 3), np.zeros((M, 5)), z(M * waves, 4), np.zeros((M * waves, 2)), z(M * E, 4),
                 z((M + 1) * 3 * E, 5), z(8), z(marks), z(M, S), z(M, S), np.zeros(2))


def pool_of(expert: np.ndarray) -> Pool:
    """The device pool holding `expert` [M, S] (-1: empty), no copy pending, no slot read yet."""
    z = lambda dt: np.zeros(expert.shape, dt)
    return Pool(np.asarray(expert, np.int64), z(np.bool_), z(np.bool_), z(np.int64), z(np.int64),
                np.full(expert.shape, -1, np.int64))


def no_commit(M: int) -> dict:
    """Prog's commit fields for a policy that commits nothing."""
    return {"rb0": np.zeros(4, np.int64), "ids": np.zeros((M, 1, 1), np.int32), "ids_ptr": np.zeros((M, 3), np.int64),
            "comm": np.zeros((M, 1), np.bool_), "comm_ptr": np.zeros((M, 3), np.int64),
            "tp": np.zeros((1, M, 1, 1), np.int16)}


def no_live(M: int) -> dict:
    """Prog's live fields for a replayed run (the trace's routes, not the read-back's, are planned)."""
    return {"rbh": np.zeros((M + 1, 1), np.float32), "lv": np.zeros((M + 1, 3), np.int64), "scr": np.zeros(1, np.int64)}


@njit(cache=True, _nrt=False)
def now(prog, ts):
    """The host clock in us since the engine's zero (CLOCK_MONOTONIC: what time.perf_counter reads)."""
    clock(prog, ts)
    return (ts[0] * 1_000_000_000 + ts[1] - prog.scal[S_HOST0]) / 1000.0


@njit(cache=True, _nrt=False)
def fail(b, rc, call):
    """The first failure kept (the call's error, which call: `Books.cnt`); -1, which every caller
    passes up, whether it returns a mark id or a status (an error code returned as a mark would
    read as one)."""
    if b.cnt[C_ERR] == 0:
        b.cnt[C_ERR], b.cnt[C_ERRCALL] = rc, call
    return -1


@njit(cache=True, _nrt=False)
def mark(prog, b, gbase, stream):
    """The pass's next event recorded on a stream: its global id (-1: failed)."""
    k = b.cnt[C_MARKS]
    if k >= b.ev.size:
        return fail(b, -1, 5)
    rc = record(prog, b.ev[k], stream)
    if rc:
        return fail(b, rc, 1)
    b.cnt[C_MARKS] = k + 1
    return gbase + k


@njit(cache=True, _nrt=False)
def evof(b, gbase, g):
    return b.ev[g - gbase]


@njit(cache=True, _nrt=False)
def launch_ok(prog, b, g, stream):
    """A graph launched on `stream`. 0, or -1."""
    rc = launch(prog, g, stream)
    return fail(b, rc, 0) if rc else 0


@njit(cache=True, _nrt=False)
def cpu_ok(prog, b, m, phase):
    """The engine's CPU work for layer m (`host_calls.cpu`). 0, or -1."""
    rc = cpu(prog, m, phase)
    return fail(b, rc, 6) if rc else 0


@njit(cache=True, _nrt=False)
def sync_ok(prog, b, ev):
    """The host waits for an event. 0, or -1."""
    rc = sync(prog, ev)
    return fail(b, rc, 3) if rc else 0


@njit(cache=True, _nrt=False)
def before_read(prog, pool, b, m, sl, stream):
    """`DevicePool.before_read`: `stream` waits for slot sl's pending copy. 1 (it waited), 0 (none
    pending) or -1."""
    if not pool.pending[m, sl]:
        return 0
    rc = wait(prog, stream, pool.ready_ev[m, sl], 0)
    if rc:
        return fail(b, rc, 2)
    pool.pending[m, sl] = False
    return 1


@njit(cache=True, _nrt=False)
def load(prog, pool, b, gbase, m, e, slot):
    """`DevicePool.load` on the copy stream: wait for the slot's last reader, the copy between
    its two marks; the slot now holds e, its copy pending. 0, or -1 (failed)."""
    cp = prog.scal[S_CP]
    if pool.was_read[m, slot]:
        rc = wait(prog, cp, pool.read_ev[m, slot], 0)
        if rc:
            return fail(b, rc, 2)
    t0 = mark(prog, b, gbase, cp)
    if t0 < 0:
        return -1
    rc = copy(prog, prog.slot_ptr[m, slot], prog.src_ptr[m, e], prog.scal[S_NBYTES], H2D, cp)
    if rc:
        return fail(b, rc, 4)
    t1 = mark(prog, b, gbase, cp)
    if t1 < 0:
        return -1
    pool.ready_ev[m, slot], pool.landed[m, slot] = evof(b, gbase, t1), t1
    pool.expert[m, slot], pool.pending[m, slot] = e, True
    i = b.cnt[C_LOADS]
    b.ld[i, 0], b.ld[i, 1], b.ld[i, 2], b.ld[i, 3], b.ld[i, 4] = m, e, slot, t0, t1
    b.cnt[C_LOADS] = i + 1
    return 0


@njit(cache=True, _nrt=False)
def layer_done(prog, pool, s, b, m, t_in, t_plan, t1, ts):
    """A MoE layer's end: its marks (entry, plan, last), the slots' snapshot, the host's time."""
    b.lay_i[m, L_TIN], b.lay_i[m, L_TPLAN], b.lay_i[m, L_LAST] = t_in, t_plan, t1
    _snapshot(pool, s, b, m, prog.scal[S_E])
    b.lay_f[m, F_LAST] = now(prog, ts)
    return 0


@njit(cache=True, _nrt=False)
def layer_entry(prog, b, gbase, m, ts):
    """A MoE layer's start: A_m's graph launched, the host's time, the entry mark (-1: failed)."""
    cs = prog.scal[S_CS]
    if launch_ok(prog, b, prog.gr[m, G_ATTN], cs):
        return -1
    b.lay_f[m, F_IN] = now(prog, ts)
    return mark(prog, b, gbase, cs)


@njit(cache=True, _nrt=False)
def read_back(prog, b, rb, stream):
    """A read-back queued on `stream`: the device rows copied into pinned memory, then its event
    recorded (rb: host address, device address, bytes, event). 0, or -1."""
    rc = copy(prog, rb[0], rb[1], rb[2], D2H, stream)
    if rc:
        return fail(b, rc, 4)
    rc = record(prog, rb[3], stream)
    if rc:
        return fail(b, rc, 1)
    return 0


@njit(cache=True, _nrt=False)
def copy_in(prog, b, dst, src, nbytes, stream):
    """A host-written input copied to the device on `stream`. 0, or -1."""
    rc = copy(prog, dst, src, nbytes, H2D, stream)
    return fail(b, rc, 4) if rc else 0


@njit(cache=True, _nrt=False)
def twin_step(prog, s, d, pd, b, p, P, m):
    """Step 1 + m of the twin's decisions (a live pass's routes first read from the layer's
    read-back, `host_live`): its buffers' starts, the plan, the skips tallied. Returns the step's
    first GPU expert and first load (their ends: d.n[0], d.n[2])."""
    j = 1 + m
    g0, l0 = d.n[0], d.n[2]
    d.g_ptr[j], d.c_ptr[j], d.l_ptr[j] = d.n[0], d.n[1], d.n[2]
    d.skipped[j] = 0
    if prog.scal[S_LIVE]:
        live_routes(prog.rbh, prog.lv, prog.scal[S_N], prog.scal[S_E], prog.scal[S_K], prog.scr, pd, prog.tp, m,
                    prog.scal[S_COMMIT] != 0)
    _plan(s, d, p, m, P, pd, s.protect, s.hits, s.placed)
    d.n[3] = j + 1
    b.cnt[C_SKIPPED] += d.skipped[j]
    return g0, l0
