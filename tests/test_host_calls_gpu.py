"""The executor's host calls through the CUDA runtime, on a GPU (marked `gpu`, skipped without
CUDA): runtime timing marks against torch's events, and whole runs through the runtime against
the same runs through torch's fallback. The pool and fallback logic's CPU twins are in
test_host_calls.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmoe.executor.cuda_rt import Runtime
from cmoe.executor.streams import Clock
from tests.test_lean_gpu import _rel, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_runtime_marks_time_the_stream_as_torch_events_do():
    """Marks on the same stream between GPU sleeps of known ratios: the runtime's and torch's put
    them in the same order with the same gaps; read marks give their events to the next ones."""
    dev = torch.device("cuda")
    cs = torch.cuda.current_stream(dev)
    on_rt, on_torch = Clock(dev), Clock(dev, rt=None)
    assert on_rt.calls == "runtime" and on_torch.calls == "torch"
    on_rt.reserve_events(12)
    pairs = []
    for n in (1, 4, 2, 8):
        torch.cuda._sleep(n * 2_000_000)
        pairs.append((on_rt.mark(cs), on_torch.mark(cs)))
    on_rt.wait(pairs[-1][0])
    torch.cuda.synchronize()
    a = np.array([on_rt.us(x) for x, _ in pairs])
    b = np.array([on_torch.us(y) for _, y in pairs])
    assert (np.diff(a) > 0).all() and (np.diff(b) > 0).all()
    assert np.allclose(np.diff(a), np.diff(b), rtol=0.02, atol=20.0), (np.diff(a), np.diff(b))
    back = set(on_rt._marks.free)
    again = on_rt.mark(cs)
    assert again.ev in back and on_rt.late == 0
    on_rt.close()


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_run_through_the_runtime_equals_one_through_torch(fused_checkpoints, family, monkeypatch):
    """Every kind of host step (loads and waves, CPU experts, commit's no-wait step and its
    inputs, look-ahead) through the runtime's calls and through torch's: the same plans and
    slots, the same logits up to the kernel's fp32 atomics, and each run says which calls it made."""
    pols = ["upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "adaptive-ahead", "commit-ahead"]
    _, rt = _run(fused_checkpoints[family], pols, tokens=6)
    monkeypatch.setattr(Runtime, "get", classmethod(lambda cls: None))
    _, th = _run(fused_checkpoints[family], pols, tokens=6)
    for a, b in zip(rt, th):
        assert a.metrics["host_calls"] == "runtime" and b.metrics["host_calls"] == "torch", a.policy
        assert a.log.plans == b.log.plans, a.policy
        assert a.log.slot_mismatches == b.log.slot_mismatches == 0, a.policy
        assert len(a.log.spans) == len(b.log.spans), a.policy
        for x, y in zip(a.logits, b.logits):
            assert _rel(x, y) < 1e-2, a.policy
