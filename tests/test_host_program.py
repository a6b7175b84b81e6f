"""The compiled host program of a graphed decode pass (`cmoe.executor.host_program`) against the
lean engine's Python step, call for call: the program runs over logging stand-ins for the CUDA
runtime, and the expected log is worked out here from the Python policy classes (their own
`begin_pass` and `plan`) in the order `lean_steps.HostSteps._host_layer` makes its calls; the
table rows each launch reads are read out of the staging buffer at the moment of their copy."""

from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
import pytest

from cmoe.executor import host_program as hp
from cmoe.executor.few_experts import twin
from cmoe.executor.host_calls import address
from cmoe.policy.policies import make_policy, trait
from cmoe.policy.pool import PoolLayout
from cmoe.policy.waves import waves as launch_waves
from cmoe.sim.replay.state import export, pass_data
from cmoe.sim.replay.twin_pool import OCC, decisions
from cmoe.trace.pass_arrays import Future, build
from cmoe.trace.passes import popularity
from tests.test_replay import tiny, tiny_deep

CS, CP, PRE, HEAD, NBYTES, EV0 = 7, 8, 1, 2, 1000, 100_000
POLICIES = ["ondemand", "lru-prefetch", "oracle", "adaptive", "commit", "lfu-fallback", "static"]
RB0 = (4000, 4001, 64, 4002)                              # layer 0's prediction read back: host, device, bytes, event


class FakeRuntime:
    """Logs every call the program makes; the clock is libc's own. One for the module (its callbacks
    must outlive the programs that call them); each test points it at its staging rows."""

    def __init__(self):
        self.log: list = []
        self.failing: tuple | None = None                 # (log entry's kind, its 1-based count, error): that call fails
        u64, i32, u32 = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint
        cb = lambda fn, *a: ctypes.CFUNCTYPE(i32, *a)(fn)
        self._keep = [cb(self._launch, u64, u64), cb(self._record, u64, u64), cb(self._wait, u64, u64, u32),
                      cb(self._sync, u64), cb(self._copy, u64, u64, ctypes.c_size_t, i32, u64)]
        self._keep_cpu = cb(self._cpu, ctypes.c_int64, ctypes.c_int64)
        libc = ctypes.CDLL(None)
        # the program's functions by address (`Prog.fn`), as the runtime's are, the engine's CPU step last
        self.fn = np.array([address(f) for f in self._keep] + [address(libc.clock_gettime), address(self._keep_cpu)],
                           np.int64)

    def use(self, prog):
        """The program's staging rows: a copy from one of them is logged as what it holds."""
        stage, self.log = prog.stage, []
        base, W, E = stage.ctypes.data, stage.shape[1], stage.shape[2]
        self.rows = {base + 4 * E * (m * W + k): ("table", m, k) for m in range(stage.shape[0]) for k in range(W)}
        self.rows.update({int(prog.ids_ptr[m, 1]): ("ids", m) for m in range(stage.shape[0])})
        self.rows.update({int(prog.comm_ptr[m, 1]): ("comm", m) for m in range(stage.shape[0])})
        self.prog = prog
        assert (prog.fn == self.fn).all()
        return hp.run

    def _rc(self) -> int:
        """0, or the error `failing` names for the call just logged."""
        if self.failing is None:
            return 0
        kind, nth, err = self.failing
        return err if self.log[-1][0] == kind and sum(c[0] == kind for c in self.log) == nth else 0

    def _launch(self, g, s):
        self.log.append(("launch", g, s))
        return self._rc()

    def _record(self, ev, s):
        self.log.append(("record", ev, s))
        return self._rc()

    def _wait(self, s, ev, flags):
        self.log.append(("wait", s, ev))
        return self._rc()

    def _sync(self, ev):
        self.log.append(("sync", ev))
        return self._rc()

    def _cpu(self, m, phase):
        self.log.append(("cpu", m, phase))
        return self._rc()

    def _copy(self, dst, src, n, kind, s):
        what = self.rows.get(src) if src else None
        if what and what[0] == "table":
            row = self.prog.stage[what[1], what[2]]
            self.log.append((*what, {int(e): int(row[e]) for e in np.nonzero(row >= 0)[0]}, s))
        elif what and what[0] == "ids":
            self.log.append((*what, self.prog.ids[what[1]].tolist(), s))
        elif what:
            self.log.append((*what, np.nonzero(self.prog.comm[what[1]])[0].tolist(), s))
        else:
            self.log.append(("copy", dst, src, n, kind, s))
        return self._rc()


_FAKE = FakeRuntime()


def _prefilled(make, pa, M):
    """A policy object that has planned the prefill (pass 0) in Python, as the engine runs it."""
    pol = make()
    pol.begin_pass(False, [])
    for m in range(M):
        pol.plan(m, pa.needed(0, m).tolist(), None)
    return pol


def _setup(name, M=3, E=6, slots=(2, 3, 2), batch=2, seed=0):
    # a look-ahead policy reads predictions three layers deep (`tiny_deep`)
    t = tiny_deep(seed, E=E, M=M, T=48) if name.endswith("-ahead") else tiny(M=M, E=E, T=48, seed=seed, requests=2, K=2)
    pa = build(t, batch)
    lay = PoolLayout(slot_bytes=(NBYTES,) * M, slots=tuple(slots), budget_bytes=NBYTES * sum(slots))
    pop = popularity(t)
    return t, pa, lay, (lambda: make_policy(name, lay, E, pop, Future(pa)))


def _prog(M, E, S, W, t=None, pa=None, K=2, N=2, few=0):
    """Handles and addresses that name themselves in the log; with a trace, commit's inputs; few:
    the most experts a launch may name and replay the few-expert twins (50 + m, 60 + m)."""
    gr = np.zeros((M, 6), np.int64)
    for m in range(M):
        gr[m] = 10 + m, 20 + m, 30 + m, 40 + m, 50 + m, 60 + m
    scal = np.array([PRE, HEAD, CS, CP, NBYTES, E, 0, K, t is not None, 0, N, few], np.int64)
    rb = np.array([[5000 + m, 6000 + m, 64, 7000 + m] for m in range(M)], np.int64)
    stage = np.full((M, W, E), -1, np.int32)
    stage_ptr = np.array([[stage.ctypes.data + 4 * E * (m * W + k) for k in range(W)] for m in range(M)], np.int64)
    slot_ptr = np.array([[10_000 + 100 * m + s for s in range(S)] for m in range(M)], np.int64)
    src_ptr = np.array([[20_000 + 100 * m + e for e in range(E)] for m in range(M)], np.int64)
    extra = hp.no_commit(M)
    if t is not None:                                     # each pass's rows' predictions, from the trace
        Kp = t.pred_experts.shape[2]
        tp = np.full((pa.num_passes, M, N, Kp), -1, np.int16)
        for p in range(pa.num_passes):
            tok = pa.tok[pa.tok_ptr[p]:pa.tok_ptr[p + 1]]
            if pa.decode[p]:
                tp[p, :, :tok.size] = t.pred_experts[tok].transpose(1, 0, 2)
        ids, comm = np.full((M, N, K), -1, np.int32), np.zeros((M, E), np.bool_)
        extra = {"rb0": np.array(RB0, np.int64), "ids": ids, "comm": comm, "tp": tp,
                 "ids_ptr": np.array([[9000 + m, ids.ctypes.data + ids[0].nbytes * m, ids[0].nbytes] for m in range(M)], np.int64),
                 "comm_ptr": np.array([[9500 + m, comm.ctypes.data + E * m, E] for m in range(M)], np.int64)}
    return hp.Prog(gr, scal, rb, np.array([8000 + m for m in range(M)], np.int64), stage, stage_ptr, slot_ptr, src_ptr,
                   **extra, **hp.no_live(M), fn=_FAKE.fn)


def _books(M, E, S, prog):
    """A pass's record buffers, their events numbered from EV0 (as the log shows them)."""
    b = hp.books(M, E, S, prog.stage.shape[1], marks=4096)
    b.ev[:] = EV0 + np.arange(b.ev.size)
    return b


class Reference:
    """The engine's calls for a pass, from the Python policy: `_begin_pass`, then per layer
    `_host_layer` (`_enter_layer`, `_plan_layer`, `_launch_waves`), then H."""

    def __init__(self, pol, prog, M, S):
        self.pol, self.prog, self.M = pol, prog, M
        self.expert = [[-1] * S for _ in range(M)]
        for m, where in enumerate(pol.pool.where):
            for e, s in where.items():
                self.expert[m][s] = e
        self.pending = [[False] * S for _ in range(M)]
        self.was_read = [[False] * S for _ in range(M)]
        self.ready, self.read = {}, {}
        self.k = 0
        self.snap: dict = {}                              # layer -> (physical, logical) after its step
        self.loads: list = []

    def mark(self, out, stream):
        ev = EV0 + self.k
        self.k += 1
        out.append(("record", ev, stream))
        return ev

    def load(self, out, ld):
        m, s = ld.layer, ld.slot
        if self.was_read[m][s]:
            out.append(("wait", CP, self.read[m, s]))
        self.mark(out, CP)
        out.append(("copy", int(self.prog.slot_ptr[m, s]), int(self.prog.src_ptr[m, ld.expert]), NBYTES, 1, CP))
        self.ready[m, s] = self.mark(out, CP)
        self.expert[m][s], self.pending[m][s] = ld.expert, True
        self.loads.append((m, ld.expert, s))

    def run(self, pa, p, tp=None):
        out, pol, M = [], self.pol, self.M
        self.k = 0
        self.loads = []
        out.append(("launch", PRE, CS))
        pred0 = []
        if tp is not None:                                # `_pred0_host`
            h0, d0, n0, e0 = (int(x) for x in self.prog.rb0)
            out += [("copy", h0, d0, n0, 2, CS), ("record", e0, CS), ("sync", e0)]
            pred0 = pa.pred[pa.pred_ptr[p * M]:pa.pred_ptr[p * M + 1]].tolist()
        # `_ahead`: a look-ahead policy's view of layers q.. in decode (the replay's `seen`)
        self.ahead = lambda q: {"ahead": pa.seen(p, q, pol.depth)} if pol.depth > 1 and pa.decode[p] else {}
        for ld in pol.begin_pass(bool(pa.decode[p]), pred0, **self.ahead(0)):
            self.load(out, ld)
        for m in range(M):
            if tp is not None:
                self.commit_layer(out, pa, p, m, tp[p, m])
                continue
            out.append(("launch", 10 + m, CS))
            self.mark(out, CS)
            host, dev, nb, ev = (int(x) for x in self.prog.rb[m])
            out += [("copy", host, dev, nb, 2, CS), ("record", ev, CS), ("sync", ev)]
            i = p * M + m
            nxt = pa.pred[pa.pred_ptr[i + 1]:pa.pred_ptr[i + 2]].tolist() if pol.uses_prediction and m + 1 < M else None
            plan = pol.plan(m, pa.needed(p, m).tolist(), nxt, **self.ahead(m + 1))
            gpu = set(plan.gpu)
            later = [ld for ld in plan.loads if ld.layer == m and ld.victim in gpu]
            for ld in plan.loads:
                if ld not in later:
                    self.load(out, ld)
            if plan.cpu:                                  # `_plan_layer`: the input to the host
                out.append(("cpu", m, 0))
            self.mark(out, CS)
            waves = launch_waves(list(plan.gpu), {ld.expert: ld.victim for ld in later}) or [[]]
            one = len(waves) == 1 and not plan.cpu
            for k, wave in enumerate(waves):
                out.append(("table", m, k, {e: plan.slots[e] for e in wave}, CS))
                for e in wave:
                    s = plan.slots[e]
                    assert self.expert[m][s] == e
                    if self.pending[m][s]:
                        out.append(("wait", CS, self.ready[m, s]))
                        self.pending[m][s] = False
                self.mark(out, CS)
                few = twin(len(wave), int(self.prog.scal[hp.S_FEW]))   # `_launch_waves`' choice
                out.append(("launch", (20 if one else 30) + (30 if few else 0) + m, CS))
                t1 = self.mark(out, CS)
                for e in wave:
                    self.read[m, plan.slots[e]], self.was_read[m][plan.slots[e]] = t1, True
                for ld in [x for x in later if x.victim in wave]:
                    self.load(out, ld)
            if plan.cpu:                                  # the CPU experts' sum joins the waves'
                out.append(("cpu", m, 1))
            if not one:
                out.append(("launch", 40 + m, CS))
                self.mark(out, CS)
            logical = [-1] * len(self.expert[m])
            for e, s in pol.pool.where[m].items():
                logical[s] = e
            self.snap[m] = (list(self.expert[m]), logical)
        out.append(("launch", HEAD, CS))
        return out


    def commit_layer(self, out, pa, p, m, tp):
        """`_commit_layer`: read-back queued, candidates, set and table, waits, launch, then the wait."""
        pol, M = self.pol, self.M
        out.append(("launch", 10 + m, CS))
        self.mark(out, CS)
        chosen = list(pol.committed[m])
        host, dev, nb, ev = (int(x) for x in self.prog.rb[m])
        out += [("copy", host, dev, nb, 2, CS), ("record", ev, CS)]
        rows = []
        for row in tp.tolist():
            mine = [e for e in dict.fromkeys(e for e in row if e >= 0) if e in chosen][:2]
            rows.append(mine + [-1] * (2 - len(mine)))
        slots = {e: pol.pool.slot_of(m, e) for e in chosen}
        out += [("ids", m, rows, CS), ("comm", m, sorted(chosen), CS), ("table", m, 0, slots, CS)]
        t_plan = self.mark(out, CS)
        waited = False
        for e in chosen:
            assert self.expert[m][slots[e]] == e
            if self.pending[m][slots[e]]:
                out.append(("wait", CS, self.ready[m, slots[e]]))
                self.pending[m][slots[e]], waited = False, True
        if waited:
            self.mark(out, CS)
        out.append(("launch", 20 + m, CS))
        t1 = self.mark(out, CS)
        for e in chosen:
            self.read[m, slots[e]], self.was_read[m][slots[e]] = t1, True
        out.append(("sync", ev))
        i = p * M + m
        nxt = pa.pred[pa.pred_ptr[i + 1]:pa.pred_ptr[i + 2]].tolist() if m + 1 < M else None
        plan = pol.plan(m, pa.needed(p, m).tolist(), nxt, **self.ahead(m + 1))
        assert list(plan.gpu) == chosen and t_plan
        for ld in plan.loads:
            self.load(out, ld)
        logical = [-1] * len(self.expert[m])
        for e, s in pol.pool.where[m].items():
            logical[s] = e
        self.snap[m] = (list(self.expert[m]), logical)


def _run_both(name, few=0, **kw):
    t, pa, lay, make = _setup(name, **kw)
    M, E, S = len(lay.slots), t.spec.num_experts, max(lay.slots)
    py, tw = _prefilled(make, pa, M), _prefilled(make, pa, M)
    commit = name.startswith("commit")
    prog = _prog(M, E, S, W=min(2 * 2, E) + 1, t=t if commit else None, pa=pa, few=few)
    ref = Reference(py, prog, M, S)
    fake = _FAKE
    s, pd, d = export(tw, pa), pass_data(pa), decisions(M + 1, 1, E)
    pool, b = hp.pool_of(np.array(ref.expert)), _books(M, E, S, prog)
    ts, waves = np.zeros(2, np.int64), np.zeros(E, np.int64)
    # the compiled entry point, as the engine calls it (`_hp_setup`), not the dispatcher
    run = hp.compile_for(fake.use(prog), prog, pool, s, d, pd, b, 0, 0, 0, ts, waves)
    assert run is not hp.run
    logs = []
    for p in range(1, pa.num_passes):
        assert pa.decode[p]
        fake.log.clear()
        want = ref.run(pa, p, prog.tp if commit else None)
        rc = run(prog, pool, s, d, pd, b, 0, p, pa.num_passes, ts, waves)
        assert rc == 0 and b.cnt[hp.C_ERR] == 0
        assert fake.log == want, (name, p)
        assert pool.expert.tolist() == ref.expert
        assert b.cnt[hp.C_MARKS] == ref.k
        assert b.ld[:b.cnt[hp.C_LOADS], :3].tolist() == [list(x) for x in ref.loads]
        for m in range(M):
            n = lay.slots[m]
            assert (b.phys[m, :n].tolist(), b.logi[m, :n].tolist()) == (ref.snap[m][0][:n], ref.snap[m][1][:n])
        assert int(s.scal[OCC]) == py.pool.occupancy()
        if py.depth > 1:                                  # the look-ahead's own state, as the class keeps it
            assert [set(np.nonzero(r)[0].tolist()) for r in s.wanted] == [set(x) for x in py.wanted]
            assert [set(np.nonzero(r)[0].tolist()) for r in s.fresh] == [set(x) for x in py.fresh]
            assert [{int(e): int(r[e]) for e in np.nonzero(r)[0]} for r in s.named] == [dict(x) for x in py.named]
        logs.append(list(fake.log))
    return logs, b, pool, s


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_the_program_makes_the_engines_calls_in_its_order(name, seed):
    logs, *_ = _run_both(name, seed=seed)
    if name != "static":                                  # static loads nothing after the prefill
        assert any(c[0] == "copy" and c[4] == 1 for log in logs for c in log), "no load was exercised"
    on_cpu = [c for log in logs for c in log if c[0] == "cpu"]
    assert bool(on_cpu) == trait(name, "cpu_experts"), "no CPU expert was exercised"


@pytest.mark.parametrize("name", ["adaptive-ahead", "commit-ahead"])
@pytest.mark.parametrize("seed", range(3))
def test_look_ahead_policies_make_the_engines_calls(name, seed):
    """Predictions three layers deep, five layers of three or four slots: the prefetches of layers
    further ahead are issued where the Python policy issues them (its `ahead` the replay's `seen`),
    and the look-ahead's state (wanted, fetched, and how often each expert was named: the deepest
    distance only names, as an expert is fetched on its second naming) is the class's after every
    pass."""
    logs, *_ = _run_both(name, M=5, slots=(3, 4, 3, 4, 3), seed=seed)
    assert sum(c[0] == "copy" and c[4] == 1 for log in logs for c in log) > 3, "too few loads to tell"


@pytest.mark.parametrize("few", [1, 2])
def test_a_launch_of_few_experts_replays_its_twin(few):
    """With the few-expert graphs captured (`few_experts`), a launch naming at most `few` experts
    replays the layer's twin (50 + m for the whole step, 60 + m for a wave) and a larger one the
    graph as before. Two slots a block at batch 2, top-2: every launch names one expert (a wave)
    or two (a wave, or the whole step), so few = 1 moves the one-expert waves to their twin and
    leaves the two-expert launches, and few = 2 moves every launch."""
    logs, *_ = _run_both("ondemand", few=few, slots=(2, 2, 2), seed=1)
    base, *_ = _run_both("ondemand", few=0, slots=(2, 2, 2), seed=1)
    kinds = lambda ls: Counter(c[1] // 10 * 10 for log in ls for c in log if c[0] == "launch" and c[1] >= 20)
    was, now = kinds(base), kinds(logs)
    assert was == {20: 7, 30: 118, 40: 59}
    assert now == ({20: 7, 30: 82, 40: 59, 60: 36} if few == 1 else {40: 59, 50: 7, 60: 118})
    undo = [[(c[0], c[1] - 30, c[2]) if c[0] == "launch" and 50 <= c[1] < 70 else c for c in log] for log in logs]
    assert undo == base                                   # the same calls in the same order, only the graphs differ


def test_a_layer_short_of_slots_runs_in_waves():
    """Two slots a block at batch 2, top-2: a miss must evict the other expert of its own layer, so
    its copy waits for that expert's launch, and the layer runs as two waves and a finish."""
    logs, *_ = _run_both("ondemand", slots=(2, 2, 2), seed=1)
    launched = [c[1] for log in logs for c in log if c[0] == "launch"]
    assert any(30 <= g < 40 for g in launched) and any(40 <= g < 50 for g in launched)


def test_the_engines_pass_arrays_are_the_simulators():
    """`lean_fast.replay_arrays` reads the replayed passes the engine gets (each layer's ranked needs
    and predictions, each row's predictions) into the same arrays `pass_arrays.build` makes from
    the trace, which the twin then reads as the replay simulator does; a pass with a padded row
    gets none (the Python step re-ranks its live rows)."""
    from types import SimpleNamespace

    from cmoe.executor.lean_fast import replay_arrays
    from cmoe.trace.passes import make_passes
    t, pa, *_ = _setup("ondemand")
    M = t.spec.num_moe_layers
    pins = []
    for i, ps in enumerate(make_passes(t, 2)):
        tok = pa.tok[pa.tok_ptr[i]:pa.tok_ptr[i + 1]]
        pins.append(SimpleNamespace(index=i, decode=ps.decode, active=np.ones(tok.size, bool),
                                    replay={"needed": [list(x) for x in ps.needed], "pred": t.pred_experts[tok],
                                            "predicted": [list(x) for x in ps.predicted]}))
    got, tp = replay_arrays(pins, M, rows=True)
    for key in ("decode", "need_ptr", "need", "pred_ptr", "pred"):
        assert np.array_equal(getattr(got, key), getattr(pa, key)), key
    assert got.num_passes == pa.num_passes and got.depth == 1
    for i, pin in enumerate(pins):
        n = pin.active.size
        assert np.array_equal(tp[i, :, :n], pin.replay["pred"].transpose(1, 0, 2))
        assert (tp[i, :, n:] == -1).all()
    assert replay_arrays(pins, M, rows=False)[1] is None
    pins[1].active[0] = False
    assert replay_arrays(pins, M, rows=True) == (None, None)


def test_the_engines_look_ahead_arrays_are_the_simulators():
    """With predictions three deep, `replay_arrays` rebuilds from each pass's `seen` (what the
    Python step hands a look-ahead plan) every entry the twin reads, (p, j, k) for j >= k, as
    `pass_arrays.build` made it from the trace; a policy looking less far gets that depth."""
    from types import SimpleNamespace

    from cmoe.executor.lean_fast import replay_arrays
    from cmoe.trace.passes import make_passes
    t, pa, *_ = _setup("adaptive-ahead", M=5, slots=(3, 4, 3, 4, 3))
    M, D = t.spec.num_moe_layers, t.depth
    assert D == 3 == pa.depth
    pins = [SimpleNamespace(index=i, decode=ps.decode, active=np.ones(2, bool),
                            replay={"needed": [list(x) for x in ps.needed], "predicted": [list(x) for x in ps.predicted],
                                    "seen": [ps.seen(q, D) for q in range(M + 1)]})
            for i, ps in enumerate(make_passes(t, 2))]
    for depth in (4, 3, 2):
        got, _ = replay_arrays(pins, M, rows=False, depth=depth)
        assert got.depth == min(depth, D)
        for p in range(pa.num_passes):
            for q in range(M):
                assert got.seen(p, q, depth) == pa.seen(p, q, min(depth, D)), (depth, p, q)
    del pins[0].replay["seen"]
    assert replay_arrays(pins, M, rows=False, depth=2) == (None, None)


def test_a_later_process_loads_the_program_from_the_cache():
    """The program calls its C functions by address (`host_calls`), so its machine code is the same
    in every process: a second process finds it in numba's cache instead of compiling it again
    (18-32 s of a first request before)."""
    import subprocess
    import sys
    from pathlib import Path
    _run_both("ondemand", seed=0)                          # compiled here (or loaded), and so on disk
    code = ("from tests.test_host_program import _run_both; from cmoe.executor import host_program as hp; "
            "_run_both('ondemand', seed=0); s = hp.run.stats; print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "0"], out.stdout



CALLS = [("launch", 2, 700), ("sync", 1, 4), ("record", 3, 719), ("copy", 1, 1)]


@pytest.mark.parametrize("name,kind,nth,err", [(n, *c) for n in ("ondemand", "commit") for c in CALLS]
                         + [("static", "cpu", 1, 1), ("static", "cpu", 2, 1)])
def test_a_failing_call_stops_the_pass(name, kind, nth, err):
    """A runtime call that returns an error (the first attention launch after P, the first read-back
    wait, a mark, a copy), or the engine's CPU step that failed (its input taken, its sum added):
    the program returns -1 at once, issues nothing after it, and keeps the error and which call made
    it; an error code never passes for a mark id."""
    t, pa, lay, make = _setup(name)
    M, E, S = len(lay.slots), t.spec.num_experts, max(lay.slots)
    tw = _prefilled(make, pa, M)
    prog = _prog(M, E, S, W=min(2 * 2, E) + 1, t=t if name == "commit" else None, pa=pa)
    run = _FAKE.use(prog)
    s, pd, d = export(tw, pa), pass_data(pa), decisions(M + 1, 1, E)
    pool, b = hp.pool_of(np.array(Reference(tw, prog, M, S).expert)), _books(M, E, S, prog)
    _FAKE.failing = (kind, nth, err)
    try:
        rc = run(prog, pool, s, d, pd, b, 0, 1, pa.num_passes, np.zeros(2, np.int64), np.zeros(E, np.int64))
    finally:
        _FAKE.failing = None
    log = _FAKE.log
    failed = [i for i, c in enumerate(log) if c[0] == kind][nth - 1]
    calls = {"launch": 0, "record": 1, "wait": 2, "sync": 3, "copy": 4, "cpu": 6}
    assert rc == -1 and failed == len(log) - 1, log[failed:]
    assert (b.cnt[hp.C_ERR], b.cnt[hp.C_ERRCALL]) == (err, calls[kind])


def test_a_pass_takes_only_the_events_the_last_pass_recorded(monkeypatch):
    """`_hp_pass` hands the program K events a pass: all K from the clock's free ones before the
    first pass, then only the n the last pass recorded (its marks, the run's until read) are
    replaced, the rest kept; a short reserve is made up and counted late; `_hp_finish` gives back
    the ones no pass recorded. No event is ever two marks at once, and none is lost."""
    from types import SimpleNamespace as NS
    from cmoe.executor.lean_fast import HostProgramSteps
    made = iter(range(1000, 2000))

    class Marks:
        free, late = [next(made) for _ in range(12)], 0

        def reserve(self, n):
            while len(self.free) < n:
                self.free.append(next(made))

    M, K, used = 2, 6, [4, 6, 0, 3, 5]
    marks = Marks()
    b = hp.books(M, 3, 2, 2, K)
    held = []

    def run(prog, pool, s, d, pd, b, gbase, p, P, ts, waves):
        held.append(b.ev.tolist())
        n = used[p]
        b.cnt[:] = 0
        b.cnt[hp.C_MARKS] = n
        b.lay_i[M - 1, hp.L_LAST] = gbase + max(n - 1, 0)
        return 0

    eng = type("Eng", (HostProgramSteps,), {"_tick": lambda self, phase: None})()
    eng.clock, eng.pool, eng.M, eng.record_plans = NS(_marks=marks), NS(compute_h=7, expert=[[0, 1], [2]]), M, False
    eng.last, eng.h_last = None, 0.0
    eng._hp = {"books": b, "marks": K, "spent": K, "prog": NS(scal=np.zeros(16, np.int64)), "gbase": 0,
               "run": run, "pool": NS(expert=np.zeros((M, 2), np.int64)), "s": None, "d": None, "pd": None,
               "P": len(used), "ts": None, "waves": None, "passes": [], "mk": {}, "ev": []}
    for p in range(len(used)):
        eng._hp_pass(NS(index=p))
    recorded = np.concatenate(eng._hp["ev"]).tolist()
    assert [len(e) for e in eng._hp["ev"]] == used and len(set(recorded)) == sum(used) == 18
    for p, ev in enumerate(held):
        assert len(set(ev)) == K                                   # K distinct events each pass
        earlier = set(np.concatenate(eng._hp["ev"][:p]).tolist()) if p else set()
        assert not earlier & set(ev)                               # none a mark not yet read
        if p:                                                      # the unused ones stayed put
            assert ev[used[p - 1]:] == held[p - 1][used[p - 1]:]
    # 12 free: 6 taken, then 4, 6 (4 made late), 0, 3 (3 made late)
    assert marks.late == 7 and marks.free == []
    monkeypatch.setattr("cmoe.sim.replay.state.restore", lambda policy, s: None)
    eng.policy, eng._hp_spans = None, lambda *a: None
    eng.pool._forget = lambda: None
    eng._hp_finish()
    assert sorted(marks.free + recorded) == list(range(1000, 1000 + 12 + 7))   # every event back or a mark
    assert marks.free == held[-1][used[-1]:]
    eng._hp_finish()                                               # a second finish gives nothing back twice
    assert marks.free == held[-1][used[-1]:]
