"""`benchmarks/gemlite_side.py`: gemlite's (codes, scales, zeros) from cmoe's bf16 (scale, zero)
pairs give the same weights, and without gemlite the benchmark says so in one line."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import gemlite_side
from cmoe.executor.kernels import dequantize


def test_gemlites_zero_point_form_dequantizes_to_cmoes_weights():
    gen = torch.Generator().manual_seed(3)
    o, i, g = 24, 256, 64
    codes = torch.randint(0, 16, (o, i), generator=gen, dtype=torch.int32)
    sz = torch.stack([torch.rand(i // g, o, generator=gen) * 0.004 + 0.001,
                      (torch.rand(i // g, o, generator=gen) - 0.5) * 0.01], -1).to(torch.bfloat16)
    w_q, s, z = gemlite_side.meta(codes, sz)
    assert (w_q.dtype, tuple(w_q.shape), s.dtype, tuple(s.shape), z.dtype, tuple(z.shape)) == (
        torch.uint8, (o, i), torch.bfloat16, (o, i // g), torch.float32, (o, i // g))
    assert torch.equal(w_q.long(), codes.long())
    theirs = ((w_q.float().reshape(o, i // g, g) - z[..., None]) * s.float()[..., None]).reshape(o, i)
    ours = dequantize(codes, sz, g)
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-6)
    assert (theirs - ours).abs().max().item() < 1e-6 < ours.abs().max().item()


def test_without_gemlite_the_status_says_how_to_bring_it(monkeypatch):
    monkeypatch.setattr(gemlite_side, "STATE", {"module": "stale", "status": "not loaded"})
    monkeypatch.setitem(sys.modules, "gemlite", None)                    # import gemlite fails
    assert gemlite_side.load() == ("not importable (ModuleNotFoundError: import of gemlite halted; None in "
                                   "sys.modules); build its wheel with bash benchmarks/gemlite_wheel.sh")
    assert gemlite_side.STATE["module"] is None


def _small(monkeypatch):
    """The benchmark at small shapes on the CPU (its plumbing, not its times)."""
    from benchmarks import expert_kernel_h200 as bench
    for k, v in (("H", 256), ("FF", 512), ("G", 128), ("DEV", "cpu")):
        monkeypatch.setattr(bench, k, v)
    monkeypatch.setattr(gemlite_side, "STATE", {"module": None, "status": "not loaded"})
    return bench


def _bench_rows(bench, gl_fails: bool) -> tuple[dict, object]:
    """The benchmark's torch rows, gemlite's layers stood in for by bf16 ones (or by one that fails)."""
    import torch.nn.functional as F
    ex = bench.Experts(16, torch.Generator().manual_seed(0))

    def broken(x):
        raise RuntimeError("no config for this shape")
    ex.gl = [{k: (broken if gl_fails and k == "w2" else (lambda x, w=w: F.linear(x, w))) for k, w in b.items()}
             for b in ex.bf]
    x, h = torch.randn(2, 256).to(torch.bfloat16), torch.randn(2, 512).to(torch.bfloat16)
    ids2 = torch.tensor([[0, 3], [3, 5]], dtype=torch.int32)
    r = {"M": 2, "w13_mine": 1.0, "w2_mine": 1.0, "expert_mine": 2.0, "layer_mine": 4.0}
    bench.torch_rows(r, x, h, ex, ids2, torch.rand(2, 2), 3, ex.lay.nbytes, (1, 1, 2, 2))
    return r, ex


def test_the_benchmark_gives_gemlite_a_column_and_drops_it_with_its_error(monkeypatch):
    bench = _small(monkeypatch)
    r, _ = _bench_rows(bench, gl_fails=False)
    assert sorted(k for k in r if "_gl" in k) == ["expert_gl", "expert_gl_tbps", "layer_gl", "layer_gl_tbps",
                                                 "w13_gl", "w13_gl_tbps", "w2_gl", "w2_gl_tbps"]
    r, ex = _bench_rows(bench, gl_fails=True)
    assert sorted(k for k in r if "gl" in k) == ["gl_error"]
    assert r["gl_error"] == "RuntimeError: no config for this shape" and ex.gl == []
    assert sorted(k for k in r if k.endswith("_tbps")) == [f"{k}_{i}_tbps" for k in ("expert", "layer", "w13", "w2")
                                                          for i in ("bf", "mine", "tg")]


def test_a_gemlite_that_cannot_pack_leaves_the_experts_without_it(monkeypatch):
    bench = _small(monkeypatch)
    calls = []

    def linear(codes, sz, group):
        calls.append(tuple(codes.shape))
        if len(calls) == 3:
            raise ValueError("unsupported group")
        return object()
    monkeypatch.setattr(gemlite_side, "linear", linear)
    ex = bench.Experts(4, torch.Generator().manual_seed(0), gl=True)
    assert calls == [(1024, 256), (256, 512), (1024, 256)]           # expert 0's two, then expert 1's w13 fails
    assert ex.gl == [] and len(ex.tg) == len(ex.bf) == 4
    assert gemlite_side.STATE == {"module": None, "status": "gemlite failed to pack: ValueError: unsupported group"}
    gemlite_side.failed("its first call", RuntimeError("x" * 400))           # the benchmark's first-call check
    assert gemlite_side.STATE == {"module": None, "status": ("gemlite failed its first call: RuntimeError: " + "x" * 400)[:300]}


def test_gemlites_rows_stop_once_its_budget_is_spent(monkeypatch):
    bench = _small(monkeypatch)
    gemlite_side.STATE.update(budget_s=5.0, spent_s=3.0, longest_s=2.5)   # the next row might take 2.5 s more
    r, ex = _bench_rows(bench, gl_fails=False)
    assert r["gl_error"] == "budget: gemlite took 3 s before this M, its longest row 2 s" and ex.gl == []
    assert not any(k.endswith("_gl") for k in r)
    gemlite_side.STATE.update(budget_s=5.0, spent_s=1.0, longest_s=0.0)
    r, _ = _bench_rows(bench, gl_fails=False)
    assert "gl_error" not in r and gemlite_side.STATE["spent_s"] > 1.0
    assert gemlite_side.STATE["longest_s"] == pytest.approx(gemlite_side.STATE["spent_s"] - 1.0, abs=1e-9)
