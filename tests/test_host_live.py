"""A live run's decode passes in the compiled host program (`cmoe.executor.host_live`): each layer's
needs and the next layer's prediction ranked from the read-back's floats exactly as the Python
step ranks them (`routes._by_weight`, then `trace.passes.ranked`), and the program's calls, over
the logging runtime of tests/test_host_program.py, those the Python policy makes from them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cmoe.executor import host_program as hp
from cmoe.executor.host_live import _ranked, layout, live_pass
from cmoe.executor.lean_fast import replay_arrays
from cmoe.executor.routes import _by_weight
from cmoe.sim.replay.state import export, pass_data
from cmoe.sim.replay.twin_pool import OCC, decisions
from cmoe.trace.passes import ranked
from tests.test_host_program import _FAKE, Reference, _books, _prefilled, _prog, _setup


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


def _live_prog(M, E, S, K, N, K2, commit):
    """Prog for a live run: rb's (and commit's rb0's) host addresses inside one float buffer, each
    read-back's columns (commit's carry the router's E logits before the prediction)."""
    prog = _prog(M, E, S, W=min(K * N, E) + 1, K=K, N=N)
    pcol = 2 * K + (E if commit else 0)
    C = pcol + 2 * K2
    rbh = np.zeros((M + 1, N * C), np.float32)
    lv = np.array([[pcol + (2 * K2 if m + 1 < M else 0), K2 if m + 1 < M else 0, pcol] for m in range(M)]
                  + [[2 * K2, K2, 0] if commit else [0, 0, 0]], np.int64)
    prog.rb[:, 0] = rbh.ctypes.data + np.arange(M) * rbh[0].nbytes
    prog.scal[hp.S_LIVE], prog.scal[hp.S_N], prog.scal[hp.S_COMMIT] = 1, N, commit
    extra = {}
    if commit:                                            # the candidates' staging, as `_prog` makes it for a trace
        ids, comm = np.full((M, N, K), -1, np.int32), np.zeros((M, E), np.bool_)
        extra = {"rb0": np.array([rbh.ctypes.data + M * rbh[0].nbytes, 4001, N * 2 * K2 * 4, 4002], np.int64),
                 "ids": ids, "comm": comm, "tp": np.full((1, M, N, K2), -1, np.int16),
                 "ids_ptr": np.array([[9000 + m, ids.ctypes.data + ids[0].nbytes * m, ids[0].nbytes] for m in range(M)], np.int64),
                 "comm_ptr": np.array([[9500 + m, comm.ctypes.data + E * m, E] for m in range(M)], np.int64)}
    if K2 or not commit:                                  # the engine's layout, worked out by `layout`
        tp_shape = extra["tp"].shape if commit else (1, M, 1, 1)
        assert np.array_equal(layout(lv[:M, 0].tolist(), lv[:M, 1].tolist(), N, K, E, commit, 2 * K2, tp_shape), lv)
    return prog._replace(rbh=rbh, lv=lv, scr=np.zeros(2 * E + max(K, K2), np.int64), **extra)


def _write_pass(prog, rng, p, M, N, K, K2, E):
    """One pass's read-backs, written where the device's copies would land them; what the Python
    step makes of them: each layer's needs, each layer's prediction (ranked), each row's."""
    needed, predicted, rows = [], [[]], np.full((1, M, N, K2), -1, np.int16)
    if prog.scal[hp.S_COMMIT]:                            # layer 0's prediction, at the pass's start
        pids, pw = _rows(rng, N, K2, E, ties=True)
        prog.rbh[M, :N * 2 * K2] = np.concatenate([pids, pw], 1).reshape(-1)
        predicted[0] = _python(pids, pw)
        rows[0, 0] = _by_weight(pids, pw)[0]
    for m in range(M):
        ids, w = _rows(rng, N, K, E, ties=p % 2 == 0)
        cols = [ids, w] + ([rng.random((N, E)).astype(np.float32)] if prog.scal[hp.S_COMMIT] else [])
        if prog.lv[m, 1]:
            pids, pw = _rows(rng, N, K2, E, ties=p % 2 == 1)
            cols += [pids, pw]
            predicted.append(_python(pids, pw))
            rows[0, m + 1] = _by_weight(pids, pw)[0]
        prog.rbh[m, :N * prog.lv[m, 0]] = np.concatenate(cols, 1).reshape(-1)
        needed.append(_python(ids, w))
    while len(predicted) < M:
        predicted.append([])
    return needed, predicted, rows


@pytest.mark.parametrize("name", ["ondemand", "lru-prefetch", "adaptive", "commit"])
@pytest.mark.parametrize("seed,N,K2", [(0, 2, 2), (1, 2, 2), (2, 2, 2), (3, 1, 2), (4, 3, 3), (5, 2, 1)])
def test_a_live_pass_makes_the_python_steps_calls(name, seed, N, K2):
    """Every decode pass planned from read-backs written just before it (as the device's copies
    would land them), the program's arrays rewritten each pass; the log, the pool, the loads and
    the twin's arrays match the Python policy planning from `_by_weight` and `ranked` (commit's
    candidates: each row's prediction by weight)."""
    t, pa, lay, make = _setup(name, seed=seed % 3)
    M, E, S, K = len(lay.slots), t.spec.num_experts, max(lay.slots), 2
    py, tw = _prefilled(make, pa, M), _prefilled(make, pa, M)
    commit = name == "commit"
    K2 = K2 if py.uses_prediction else 0
    prog = _live_prog(M, E, S, K, N, K2, commit)
    ref, run = Reference(py, prog, M, S), _FAKE.use(prog)
    lp = live_pass(M, E)
    s, pd, d = export(tw, lp), pass_data(lp), decisions(M + 1, 1, E)
    pool, b = hp.pool_of(np.array(ref.expert)), _books(M, E, S, prog)
    rng = np.random.default_rng(seed)
    loads = 0
    for p in range(6):
        needed, predicted, rows = _write_pass(prog, rng, p, M, N, K, K2, E)
        want_pa, _ = replay_arrays([SimpleNamespace(index=0, decode=True, active=np.ones(N, bool),
                                                    replay={"needed": needed, "predicted": predicted})], M, rows=False)
        _FAKE.log.clear()
        want = ref.run(want_pa, 0, rows if commit else None)
        rc = run(prog, pool, s, d, pd, b, 0, 0, 1, np.zeros(2, np.int64), np.zeros(E, np.int64))
        assert rc == 0 and b.cnt[hp.C_ERR] == 0
        assert _FAKE.log == want, (name, p)
        assert pool.expert.tolist() == ref.expert
        assert b.ld[:b.cnt[hp.C_LOADS], :3].tolist() == [list(x) for x in ref.loads]
        for m in range(M):
            assert lp.needed(0, m).tolist() == needed[m]
            if K2 and (m or commit):
                assert lp.pred[lp.pred_ptr[m]:lp.pred_ptr[m + 1]].tolist() == predicted[m]
        if commit:
            assert np.array_equal(prog.tp, rows)
        assert int(s.scal[OCC]) == py.pool.occupancy()
        loads += int(b.cnt[hp.C_LOADS])
    assert loads, "no load was exercised"


def test_commits_rows_are_the_python_steps():
    """Each row's prediction by weight (commit's candidates), ties in column order."""
    from cmoe.executor.host_live import _by_weight as rows_by_weight
    for seed in range(20):
        rng = np.random.default_rng(seed)
        N, K = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        ids, w = _rows(rng, N, K, 12, ties=seed % 2 == 0)
        out = np.full((N, K + 1), -7, np.int16)
        rows_by_weight(np.concatenate([ids, w], 1).reshape(-1), N, 2 * K, K, 0, K, out, np.zeros(K, np.int64))
        assert out[:, :K].tolist() == _by_weight(ids, w)[0] and (out[:, K] == -7).all()


def test_the_layout_is_the_read_backs():
    """Columns a row as `_readback_parts` lays them out: ids and weights (K each), commit's E
    logits, the next layer's prediction (K2 ids and weights) where there is one; anything else,
    or commit's candidate rows too narrow for its prediction, leaves the run to the Python step."""
    K, E, N = 2, 8, 3
    assert layout([8, 8, 4], [2, 2, 0], N, K, E, False, 0, (1, 3, 1, 1)).tolist() == \
        [[8, 2, 4], [8, 2, 4], [4, 0, 4], [0, 0, 0]]
    assert layout([4, 4], [0, 0], N, K, E, False, 0, (1, 2, 1, 1)).tolist() == [[4, 0, 4], [4, 0, 4], [0, 0, 0]]
    got = layout([16, 16, 12], [2, 2, 0], N, K, E, True, 4, (1, 3, N, 2))
    assert got.tolist() == [[16, 2, 12], [16, 2, 12], [12, 0, 12], [4, 2, 0]]
    assert layout([16, 16, 12], [2, 2, 0], N, K, E, True, 4, (1, 3, N, 1)) is None          # rows too narrow
    assert layout([16, 16, 12], [2, 2, 0], N, K, E, True, 4, (1, 3, N + 1, 2)) is None      # rows for another batch
    assert layout([16, 18, 12], [2, 3, 0], N, K, E, True, 4, (1, 3, N, 2)) is None          # a wider prediction
    assert layout([16, 12, 12], [2, 0, 0], N, K, E, True, 4, (1, 3, N, 2)) is None          # commit without one
    assert layout([9, 8, 4], [2, 2, 0], N, K, E, False, 0, (1, 3, 1, 1)) is None            # a column too many


def test_an_id_outside_the_experts_is_no_expert():
    """A read-back id of E or more (corrupt floats) is skipped, never counted past the scratch."""
    ids = np.array([[2, 9], [1, 2]], np.float32)        # E = 4: 9 is no expert
    w = np.array([[0.6, 0.4], [0.7, 0.3]], np.float32)
    out = np.full(4, -5, np.int16)
    n = _ranked(np.concatenate([ids, w], 1).reshape(-1), 2, 4, 2, 0, 2, 4, np.zeros(10, np.int64), out)
    assert out[:n].tolist() == [2, 1]


@pytest.mark.parametrize("commit", [False, True])
def test_the_engine_points_each_read_back_into_one_buffer(commit):
    """`_hp_live_inputs` on the engine's read-back tensors (the CPU stands in for the pinned
    memory): each layer's host address a row of one float buffer, commit's layer-0 prediction its
    last row, the columns `layout` gives, the live flag and the rows set."""
    import torch

    from cmoe.executor.lean_fast import HostProgramSteps
    M, K, E, N, K2 = 3, 2, 6, 2, 2
    pcol = 2 * K + (E if commit else 0)
    rbs = [torch.zeros(N, pcol + (2 * K2 if m + 1 < M else 0)) for m in range(M)]
    eng = SimpleNamespace(M=M, spec=SimpleNamespace(top_k=K, num_experts=E), commit=commit, cuda=False, _hp_rbh=None,
                          policy=SimpleNamespace(uses_prediction=True),
                          t_graph={"rb": rbs, "rb0": torch.zeros(N, 2 * K2),
                                   "pred": [(torch.zeros(N, K2, dtype=torch.long), torch.zeros(N, K2))] * M})
    rb = np.tile(np.array([[11, 12, 13, 14]], np.int64), (M, 1))
    scal = np.zeros(12, np.int64)
    extra = {"rb0": np.array([21, 22, 23, 24], np.int64),
             "tp": np.full((1, M, N, K2), -1, np.int16) if commit else np.zeros((1, M, 1, 1), np.int16)}
    got = HostProgramSteps._hp_live_inputs(eng, rb, scal, extra)
    C = max(r.shape[1] for r in rbs)
    base = eng._hp_rbh.data_ptr()
    assert eng._hp_rbh.shape == (M + 1, N * C) and got["rbh"].ctypes.data == base
    assert rb[:, 0].tolist() == [base + m * N * C * 4 for m in range(M)] and (rb[:, 1:] == [12, 13, 14]).all()
    assert extra["rb0"].tolist() == ([base + M * N * C * 4] if commit else [21]) + [22, 23, 24]
    assert got["lv"].tolist() == [[pcol + 2 * K2, K2, pcol]] * 2 + [[pcol, 0, pcol], [2 * K2, K2, 0] if commit else [0, 0, 0]]
    assert scal[hp.S_LIVE] == 1 and scal[hp.S_N] == N and got["scr"].size == 2 * E + K
    rbs[1] = torch.zeros(N, pcol + 2 * K2 + 1)             # a column the program would misread: the Python step
    assert HostProgramSteps._hp_live_inputs(eng, rb, scal, extra) is None
