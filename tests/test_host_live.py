"""A live run's decode passes in the compiled host program (`cmoe.executor.host_live`): each layer's
needs and the next layer's prediction ranked from the read-back's floats exactly as the Python
step ranks them (`routes._by_weight`, then `trace.passes.ranked`), and the program's calls, over
the logging runtime of tests/test_host_program.py, those the Python policy makes from them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cmoe.executor import host_program as hp
from cmoe.executor.host_live import _ranked, live_pass
from cmoe.executor.lean_fast import replay_arrays
from cmoe.executor.routes import _by_weight
from cmoe.sim.replay.state import export, pass_data
from cmoe.sim.replay.twin_pool import OCC, decisions
from cmoe.trace.passes import ranked
from tests.test_host_program import _FAKE, EV0, Reference, _prog, _setup


def _rows(rng, N, K, E, ties):
    """N rows of K expert ids (now and then a -1) and weights (ties among few values)."""
    ids = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.float32)
    ids[rng.random(ids.shape) < 0.1] = -1
    w = (rng.integers(0, 3, (N, K)) / 4 if ties else rng.random((N, K))).astype(np.float32)
    return ids, w


def _python(ids, w) -> list[int]:
    return list(ranked(_by_weight(ids, w)[0])[0])


@pytest.mark.parametrize("seed", range(40))
def test_the_ranking_is_the_python_steps(seed):
    rng = np.random.default_rng(seed)
    N, K, E = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(4, 20))
    K = min(K, E)
    ids, w = _rows(rng, N, K, E, ties=seed % 2 == 0)
    pad = int(rng.integers(0, 3))                         # columns after the weights (a prediction)
    v = np.concatenate([ids, w, np.full((N, pad), 7, np.float32)], 1).reshape(-1)
    out = np.full(E, -9, np.int16)
    scr = np.zeros(2 * E + K, np.int64)
    n = _ranked(v, N, 2 * K + pad, K, 0, K, E, scr, out)
    assert out[:n].tolist() == _python(ids, w)


def test_ties_keep_the_first_seen_order():
    """Two rows, equal weights: row 0's columns in order, then row 1's new expert; counts first."""
    ids = np.array([[3, 1], [1, 2]], np.float32)
    w = np.array([[0.5, 0.5], [0.25, 0.75]], np.float32)
    out = np.zeros(6, np.int16)
    n = _ranked(np.concatenate([ids, w], 1).reshape(-1), 2, 4, 2, 0, 2, 6, np.zeros(14, np.int64), out)
    assert out[:n].tolist() == [1, 3, 2] == _python(ids, w)


def _live_prog(M, E, S, K, N, K2):
    """Prog for a live run: rb's host addresses inside one float buffer, each layer's columns."""
    prog = _prog(M, E, S, W=min(K * N, E) + 1, K=K, N=N)
    C = 2 * K + 2 * K2
    rbh = np.zeros((M, N * C), np.float32)
    lv = np.array([[2 * K + (2 * K2 if m + 1 < M else 0), K2 if m + 1 < M else 0] for m in range(M)], np.int64)
    prog.rb[:, 0] = rbh.ctypes.data + np.arange(M) * rbh[0].nbytes
    prog.scal[hp.S_LIVE], prog.scal[hp.S_N] = 1, N
    return prog._replace(rbh=rbh, lv=lv, scr=np.zeros(2 * E + max(K, K2), np.int64))


@pytest.mark.parametrize("name", ["ondemand", "lru-prefetch", "adaptive"])
@pytest.mark.parametrize("seed", range(3))
def test_a_live_pass_makes_the_python_steps_calls(name, seed):
    """Every decode pass planned from read-backs written just before it (as the device's copies
    would land them), the program's arrays rewritten each pass; the log, the pool, the loads and
    the twin's arrays match the Python policy planning from `_by_weight` and `ranked`."""
    t, pa, lay, make = _setup(name, seed=seed)
    M, E, S, K, N = len(lay.slots), t.spec.num_experts, max(lay.slots), 2, 2
    py, tw = make(), make()
    K2 = K if py.uses_prediction else 0
    for pol in (py, tw):                                  # the prefill, in Python
        pol.begin_pass(False, [])
        for m in range(M):
            pol.plan(m, pa.needed(0, m).tolist(), None)
    prog = _live_prog(M, E, S, K, N, K2)
    ref, run = Reference(py, prog, M, S), _FAKE.use(prog)
    lp = live_pass(M, E)
    s, pd, d = export(tw, lp), pass_data(lp), decisions(M + 1, 1, E)
    pool = hp.Pool(np.array(ref.expert, np.int64), np.zeros((M, S), np.bool_), np.zeros((M, S), np.bool_),
                   np.zeros((M, S), np.int64), np.zeros((M, S), np.int64), np.full((M, S), -1, np.int64))
    b = hp.books(M, E, S, prog.stage.shape[1], marks=4096)
    b.ev[:] = EV0 + np.arange(b.ev.size)
    rng = np.random.default_rng(seed)
    loads = 0
    for p in range(6):
        needed, predicted = [], [[]]
        for m in range(M):
            ids, w = _rows(rng, N, K, E, ties=p % 2 == 0)
            cols = [ids, w]
            if prog.lv[m, 1]:
                pids, pw = _rows(rng, N, K2, E, ties=p % 2 == 1)
                cols += [pids, pw]
                predicted.append(_python(pids, pw))
            prog.rbh[m, :N * prog.lv[m, 0]] = np.concatenate(cols, 1).reshape(-1)
            needed.append(_python(ids, w))
        while len(predicted) < M:
            predicted.append([])
        want_pa, _ = replay_arrays([SimpleNamespace(index=0, decode=True, active=np.ones(N, bool),
                                                    replay={"needed": needed, "predicted": predicted})], M, rows=False)
        _FAKE.log.clear()
        want = ref.run(want_pa, 0)
        rc = run(prog, pool, s, d, pd, b, 0, 0, 1, np.zeros(2, np.int64), np.zeros(E, np.int64))
        assert rc == 0 and b.cnt[hp.C_ERR] == 0
        assert _FAKE.log == want, (name, p)
        assert pool.expert.tolist() == ref.expert
        assert b.ld[:b.cnt[hp.C_LOADS], :3].tolist() == [list(x) for x in ref.loads]
        for m in range(M):
            assert lp.needed(0, m).tolist() == needed[m]
            if K2 and m + 1 < M:
                assert lp.pred[lp.pred_ptr[m + 1]:lp.pred_ptr[m + 2]].tolist() == predicted[m + 1]
        assert int(s.scal[OCC]) == py.pool.occupancy()
        loads += int(b.cnt[hp.C_LOADS])
    assert loads, "no load was exercised"
