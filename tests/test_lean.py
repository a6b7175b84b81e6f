"""The lean engine on the CPU, where it runs the same program without graphs: the static cache's
mask, the launch waves of a layer, every family through the one-launch layer kernel (its torch
reference here) against the unmodified model with the same dequantized experts, the same
decisions as the reference engine, and upper's decode with no host step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmoe.executor.kv import StaticKV
from cmoe.executor.lean_steps import _waves
from cmoe.policy.policies import POLICIES, trait, Load
from tests.test_executor import _dequantize_experts, reference_logits, run_exec

EXACT = [p for p in POLICIES if not trait(p, "skips") and p != "oracle"]


def test_static_cache_mask_and_writes():
    kv = StaticKV(2, 6, torch.device("cpu"))
    mask = kv.prefill(3, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert mask.shape == (2, 1, 3, 6)
    # row 0 is left-padded by one: its real queries see slots 1..i, its padding query sees itself
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    keys, _ = kv.update(k, k + 100, 0)
    assert torch.equal(keys[:, :, :3], k) and keys[:, :, 3:].abs().sum() == 0
    assert kv.step() == 3
    assert kv.decode_mask[0, 0, 0].int().tolist() == [0, 1, 1, 1, 0, 0]
    keys, vals = kv.update(torch.full((2, 1, 1, 2), 7.0), torch.full((2, 1, 1, 2), 8.0), 0)
    assert keys[:, :, 3].eq(7).all() and vals[:, :, 3].eq(8).all() and keys[:, :, 4:].abs().sum() == 0
    kv.step(), kv.step()
    with pytest.raises(ValueError, match="all are used"):
        kv.step()


def test_waves_follow_deferred_loads():
    later = [Load(0, 5, 1, 2, "demand"), Load(0, 6, 1, 5, "demand"), Load(0, 7, 0, 3, "demand")]
    assert _waves([2, 3, 5, 6, 7], later) == [[2, 3], [5, 7], [6]]
    assert _waves([1, 2], []) == [[1, 2]]
    assert _waves([], []) == []
    from cmoe.policy.waves import waves                # none deferred: the shortcut says what waves says
    for gpu in ([], [4], [3, 1, 7], list(range(8))):
        got = _waves(gpu, [])
        assert got == waves(gpu, {}) and all(w is not gpu for w in got)     # lists of its own, as waves makes


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_fused_layer_kernel_reproduces_the_dequantized_model(fused_checkpoints, family):
    """int4 experts in the tiled layout, one launch per layer (the torch reference on the CPU),
    every exact policy, batch 2 with left padding: the unmodified model with the same dequantized
    experts, to fp32 rounding."""
    w, results = run_exec(fused_checkpoints[family], EXACT, fmt="w4g32", kernel="fused")
    assert w.store.packing == "tiled"
    ref = reference_logits(fused_checkpoints[family], w.prompts, 4, _dequantize_experts(32))
    for r in results:
        for a, b in zip(r.logits, ref):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (r.policy, (a - b).abs().max().item())
        assert r.log.slot_mismatches == 0
    m = {r.policy: r.metrics for r in results}
    assert m["ondemand"]["loads"] > 0 and m["static"]["fallbacks"] > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_lean_and_reference_engines_decide_alike(fused_checkpoints, family):
    """Both engines, every policy (commit included), live routing: identical plans and counts
    (DeepSeek's routers return their top-k unsorted: both engines rank each token's experts by
    weight, upper's bookkeeping after the pass included)."""
    pols = [p for p in POLICIES if p != "oracle"]
    _, lean = run_exec(fused_checkpoints[family], pols, fmt="w4g32", kernel="fused")
    _, ref = run_exec(fused_checkpoints[family], pols, fmt="w4g32", engine="hf")
    for a, b in zip(lean, ref):
        assert [(p.pass_index, p.layer, p.needed, p.loads, p.gpu, p.cpu, p.skipped) for p in a.log.plans] == \
            [(p.pass_index, p.layer, p.needed, p.loads, p.gpu, p.cpu, p.skipped) for p in b.log.plans], a.policy
        for k in ("loads", "hits", "late", "demand", "fallbacks", "skipped"):
            assert a.metrics[k] == b.metrics[k], (a.policy, k)
        for x, y in zip(a.logits, b.logits):
            assert torch.allclose(x, y, atol=2e-5, rtol=1e-4), a.policy


def test_upper_decode_has_no_host_step(fused_checkpoints):
    _, (r,) = run_exec(fused_checkpoints["mixtral"], ["upper"], fmt="w4g32", kernel="fused")
    dec = {p for p, d, _, _ in r.log.pass_us if d}
    host_ops = {s[4] for s in r.log.spans if s[1] in dec and s[3] == "host"}
    assert host_ops == {"host_attention", "host_head"}
    experts = [s for s in r.log.spans if s[1] in dec and s[4] == "expert"]
    assert len(experts) == r.metrics["hits"] and r.metrics["loads"] == 0
    assert len(r.log.plans) == len(r.log.pass_us) * (1 + len(r.layout.slots))
    assert np.all([s[6] <= s[7] for s in experts])
    assert (r.metrics["host_calls"], r.metrics["late_events"]) == ("host", 0)     # no device calls on the CPU


def test_marks_resolve_late_as_on_a_busy_gpu(fused_checkpoints, monkeypatch):
    """On a GPU a pass's marks may not have happened when the next pass settles; here no mark is
    ever ready before the end, and the timeline is the same as when each was ready at once."""
    _, ready = run_exec(fused_checkpoints["mixtral"], ["upper", "ondemand"], fmt="w4g32", kernel="fused")
    from cmoe.executor.streams import Clock
    monkeypatch.setattr(Clock, "done", lambda self, h: False)
    _, late = run_exec(fused_checkpoints["mixtral"], ["upper", "ondemand"], fmt="w4g32", kernel="fused")
    for a, b in zip(ready, late):
        key = lambda s: (s[1], s[2], s[3], s[4], s[5])   # noqa: E731
        assert sorted(map(key, a.log.spans)) == sorted(map(key, b.log.spans)), a.policy
        assert a.metrics["loads"] == b.metrics["loads"] and a.metrics["hits"] == b.metrics["hits"]


def test_spans_left_to_finish_give_the_same_timeline(fused_checkpoints, monkeypatch):
    """On CUDA a pass settles its times but leaves its span marks to `finish` (turning them into
    microseconds between passes held the GPU idle); forced here on the CPU: no span is resolved
    before the end, and the timeline and counts are those of settling every pass."""
    from cmoe.executor.lean import LeanEngine
    _, each = run_exec(fused_checkpoints["mixtral"], ["upper", "ondemand", "commit"], fmt="w4g32", kernel="fused")
    init, resolve, calls = LeanEngine.__init__, LeanEngine._resolve, []

    def late_init(self, *a, **kw):
        init(self, *a, **kw)
        assert self.spans_each_pass                      # the CPU's default: every pass
        self.spans_each_pass = False

    def spy(self, final):
        calls.append(final)
        return resolve(self, final)
    monkeypatch.setattr(LeanEngine, "__init__", late_init)
    monkeypatch.setattr(LeanEngine, "_resolve", spy)
    _, late = run_exec(fused_checkpoints["mixtral"], ["upper", "ondemand", "commit"], fmt="w4g32", kernel="fused")
    assert calls == [False, True] * 3                    # per run only finish's: its settle, then the final one
    for a, b in zip(each, late):
        key = lambda s: (s[1], s[2], s[3], s[4], s[5])   # noqa: E731
        assert sorted(map(key, a.log.spans)) == sorted(map(key, b.log.spans)), a.policy
        assert len(a.log.pass_us) == len(b.log.pass_us)
        assert {k: a.metrics[k] for k in ("loads", "hits", "skipped")} == {k: b.metrics[k] for k in ("loads", "hits", "skipped")}


def test_replay_of_a_trace_without_predictions(tiny_trace, checkpoints, tmp_path):
    """An imported routing log has no predictions (all -1): exact policies replay it."""
    from cmoe.executor.run import ExecConfig, execute, prepare
    from cmoe.trace import bundle
    t = bundle.read(str(tiny_trace))
    t.pred_experts[:] = -1
    t.pred_ahead = None                              # as an imported log: no predictions at any distance
    bundle.write(t, tmp_path / "nopred")
    cfg = ExecConfig(policies=("upper", "ondemand"), slots=2, batch=1, tokens=3, device="cpu", quant="fp32")
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tmp_path / "nopred"),
                     data=None, cfg=cfg)
    assert [r.metrics["decode_passes"] for r in execute(w, cfg)] == [3, 3]


def test_a_sliding_window_shorter_than_the_run_is_refused():
    from types import SimpleNamespace

    from cmoe.core.errors import CmoeError
    from cmoe.executor.kv import check_window as _check_window
    _check_window(SimpleNamespace(sliding_window=None), 10_000)
    _check_window(SimpleNamespace(sliding_window=64, use_sliding_window=False), 10_000)
    _check_window(SimpleNamespace(sliding_window=4096), 320)
    with pytest.raises(CmoeError, match="sliding window of 64 tokens and the run needs 320"):
        _check_window(SimpleNamespace(sliding_window=64), 320)


def test_commit_launches_its_committed_layers_before_the_read_back(fused_checkpoints, monkeypatch):
    """commit in decode takes the no-wait step on every MoE layer of every decode pass (OWA on the
    device: the logits equal the reference engine's, see test_lean_and_reference_engines_decide_alike);
    its host lane then waits for the read-back after the experts' launch, not before, and the
    read-back's copy is queued ahead of the launch. The pass's start waits for its layer-0
    prediction as a `host_sync` span of the first MoE layer, after that layer's own host work."""
    from cmoe.executor.lean import LeanEngine
    calls, order = [], []
    orig = LeanEngine._commit_layer
    monkeypatch.setattr(LeanEngine, "_commit_layer", lambda self, m, g: (calls.append(m), orig(self, m, g))[1])
    for name in ("_read_back_start", "_run_x", "_read_back_wait"):
        real = getattr(LeanEngine, name)
        monkeypatch.setattr(LeanEngine, name, lambda *a, _n=name, _f=real: (order.append(_n), _f(*a))[1])
    w, (r,) = run_exec(fused_checkpoints["mixtral"], ["commit"], fmt="w4g32", kernel="fused", tokens=3)
    assert len(calls) == 3 * w.spec.num_moe_layers
    # the read-back copy is queued before the experts (so its wait ends with A_m), waited for after;
    # each decode pass first waits for its layer-0 prediction's read-back (`_read_back_pred0`)
    per_pass = ["_read_back_wait"] + ["_read_back_start", "_run_x", "_read_back_wait"] * w.spec.num_moe_layers
    n = len(order) - 3 * len(per_pass)
    assert order[n:] == per_pass * 3
    dec = {p for p, d, _, _ in r.log.pass_us if d}
    for p in dec:
        lane = sorted((s for s in r.log.spans if s[1] == p and s[3] == "host" and s[2] == w.spec.moe_layers[1]
                       and s[4] != "host_predict"),
                      key=lambda s: s[6])
        assert [s[4] for s in lane] == ["host_attention", "host_expert", "host_sync", "host_route"]
        first = sorted((s for s in r.log.spans if s[1] == p and s[3] == "host" and s[2] == w.spec.moe_layers[0]
                        and s[4] != "host_predict"), key=lambda s: s[6])
        assert [s[4] for s in first] == ["host_attention", "host_sync", "host_attention", "host_expert",
                                         "host_sync", "host_route"]
        assert first[0][7] == first[1][6] and first[1][7] == first[2][6]   # back to back: nothing counted twice


def test_owa_on_the_device_equals_the_host_rule():
    from cmoe.executor.lean_steps import owa_device
    from cmoe.policy.owa import owa_weights
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 8, generator=g)
    comm = torch.zeros(8, dtype=torch.bool)
    comm[[1, 4, 6]] = True
    ids = torch.tensor([[4, 1], [6, -1], [-1, -1], [1, 6], [-1, -1]])
    for renorm, sig, scale in ((True, False, 1.0), (False, False, 1.0), (False, True, 2.5)):
        got_ids, got_w = owa_device(logits, ids, comm, 2, renorm, scale, sig)
        s = torch.sigmoid(logits.double()) if sig else torch.softmax(logits.double(), -1)
        for i in range(5):
            mine = [e for e in ids[i].tolist() if e >= 0] or [max([1, 4, 6], key=lambda e: s[i, e].item())]
            want = owa_weights(s[i].tolist(), mine, 2, renorm, scale)
            assert [e for e in got_ids[i].tolist() if e >= 0] == mine
            assert got_w[i, :len(mine)].tolist() == pytest.approx(want, rel=1e-6)
            assert got_w[i, len(mine):].abs().sum() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_decode_passes_take_the_lean_attention(fused_checkpoints, monkeypatch, family):
    """Every decode pass of every layer goes through the lean attention step, no prefill does;
    MLA (DeepSeek) keeps its module's own. The logits are checked against the unmodified model
    in test_fused_layer_kernel_reproduces_the_dequantized_model."""
    from cmoe.executor import attention
    calls = []
    real = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    _, (r,) = run_exec(fused_checkpoints[family], ["upper"], fmt="w4g32", kernel="fused", tokens=4)
    decode = sum(1 for _, d, _, _ in r.log.pass_us if d)
    layers = len(r.layout.slots) + (1 if family == "deepseek_v2" else 0)
    assert decode == 4                                    # --tokens 4: a prefill, then 4 decode passes
    assert calls == ([2] * decode * layers if family == "qwen3_moe" else [])


def _marks_by_layer(monkeypatch, model_dir, policies):
    """Run `policies` on the CPU, keeping each MoE layer's host step's timing marks (each a
    cudaEventRecord on CUDA) by the function that made it, and the mark it left in `last`."""
    import sys

    from cmoe.executor.lean import LeanEngine
    from cmoe.executor.streams import Clock
    made, steps = [], []
    mark, host_layer = Clock.mark, LeanEngine._host_layer

    def spy_mark(self, stream=None):
        t = mark(self, stream)
        made.append((sys._getframe(1).f_code.co_name, t))
        return t

    def spy_layer(self, m, graphs):
        n = len(made)
        host_layer(self, m, graphs)
        steps.append((self.policy.name, self.cur.index, self.cur.decode, m, made[n:], self.last))
    monkeypatch.setattr(Clock, "mark", spy_mark)
    monkeypatch.setattr(LeanEngine, "_host_layer", spy_layer)
    _, results = run_exec(model_dir, policies, fmt="w4g32", kernel="fused")
    plans = {(r.policy, p.pass_index, p.layer): p for r in results for p in r.log.plans}
    return steps, plans


def test_each_layer_marks_its_entry_plan_and_launches_once(fused_checkpoints, monkeypatch):
    """The marks of a loading policy's layer: its entry, its plan, each launch's start and end, two
    a load (on the copy stream), a CPU experts' wait mark, and an exit mark only where something
    follows the last launch on the compute stream: a one-launch layer's launch end is its `last`,
    where the next layer's attention begins. upper: its entry and its launch's end. commit's decode:
    its entry, its plan, and its launch's start only where a copy is waited for (never on the CPU)."""
    steps, plans = _marks_by_layer(monkeypatch, fused_checkpoints["mixtral"],
                                   ["upper", "ondemand", "lfu-fallback", "commit"])
    seen = set()
    for pol, p, decode, m, made, last in steps:
        names = [n for n, _ in made if n != "load"]
        if pol == "upper":
            assert names == ["_enter_layer", "_host_layer"] and last is made[-1][1]
            continue
        if pol == "commit" and decode:
            assert names == ["_enter_layer", "_commit_layer", "_commit_layer"]
            assert last is [t for n, t in made if n != "load"][-1]            # its launch's end
            assert sum(n == "load" for n, _ in made) == 2 * len(plans[(pol, p, m)].loads)
            seen.add((pol, decode))
            continue
        plan = plans[(pol, p, m)]
        assert sum(n == "load" for n, _ in made) == 2 * len(plan.loads)
        w = names.count("_launch_waves") // 2
        one = w == 1 and not plan.cpu
        assert names == ["_enter_layer", "_host_layer"] + ["_launch_waves"] * 2 * w + \
            ["_cpu_sum"] * bool(plan.cpu) + ["_host_layer"] * (not one), (pol, p, m)
        launch_end = [t for n, t in made if n == "_launch_waves"][-1]
        assert (last is launch_end) == one and last is [t for n, t in made if n != "load"][-1]
        seen.add((pol, one, w > 1, bool(plan.cpu)))
    assert {("ondemand", True, False, False), ("ondemand", False, True, False),
            ("lfu-fallback", False, False, True), ("commit", True)} <= seen


def test_a_spinning_read_back_wait_polls_the_event_until_it_has_happened():
    """CMOE_WAIT=spin (the A/B `benchmarks/lean_h200.py --wait-ablation` measures): the host polls
    the read-back's runtime event instead of synchronizing on it, and returns the same buffer."""
    from types import SimpleNamespace

    from cmoe.executor.lean_io import HostIO
    calls = []

    class RT:
        def query(self, ev):
            calls.append(("query", ev))
            return len(calls) >= 3

        def sync(self, ev):
            calls.append(("sync", ev))
    io = HostIO()
    io.clock = SimpleNamespace(rt=RT())
    buf = object()
    io._spin = True
    assert io._read_back_wait((buf, 7)) is buf and calls == [("query", 7)] * 3
    calls.clear()
    io._spin = False
    assert io._read_back_wait((buf, 7)) is buf and calls == [("sync", 7)]
    calls.clear()
    assert io._read_back_wait((buf, None)) is buf and calls == []


def test_the_programs_cpu_step_does_the_python_steps_cpu_work(fused_checkpoints, monkeypatch):
    """`_cpu_step`, which the compiled host program calls back for a layer with CPU experts, at
    every CPU-expert layer of lfu-fallback and static beside the Python step's own `_cpu_sum`: the
    same experts, rows, weights and input, the same sum added to the waves' (exactly, on the CPU),
    the layer's fallbacks counted once; a failure is kept, not raised through the C frames."""
    from types import SimpleNamespace as NS
    from cmoe.executor.lean import LeanEngine
    real, seen = LeanEngine._cpu_sum, []

    def spy(self, m, d, st):
        if self._hp is not None:                           # called back from `_cpu_step`
            seen[-1].append(st)
            return real(self, m, d, st)
        want = real(self, m, d, st)
        saved, tally = (self._hp, self._wave_acc), self.log.at(self.cur.index)
        before = tally.fallbacks
        # the twin's decisions: step 1 + m's CPU experts after step m's (an expert never routed, 99)
        self._hp = {"d": NS(c_e=np.array([99] + st["cpu"] + [99], np.int64), c_ptr=np.array([0] * m + [0, 1, 9]),
                            n=np.array([0, 1 + len(st["cpu"]), 0, 0]))}
        self._wave_acc = torch.zeros(want.shape, dtype=torch.float32)
        seen.append([self.policy.name, st])
        assert self._cpu_step(m, 0) == 0 and self._cpu_step(m, 1) == 0
        assert torch.equal(self._wave_acc, want) and tally.fallbacks == before + len(st["cpu"])
        tally.fallbacks = before
        self._hp, self._wave_acc = saved
        return want
    monkeypatch.setattr(LeanEngine, "_cpu_sum", spy)
    _, results = run_exec(fused_checkpoints["mixtral"], ["lfu-fallback", "static"], fmt="w4g32", kernel="fused")
    assert {r.policy for r in results if r.metrics["fallbacks"] > 0} == {"lfu-fallback", "static"}
    assert {name for name, *_ in seen} == {"lfu-fallback", "static"}
    for name, st, got in seen:
        assert (got["cpu"], got["assign"]) == (st["cpu"], st["assign"]) and got["x_host"] is not None, name
    bad = LeanEngine.__new__(LeanEngine)                  # a step that fails keeps its exception
    bad._hp, bad.spec, bad.clock = {}, NS(moe_layers=[0], top_k=2), None
    assert bad._cpu_step(0, 1) == 1 and isinstance(bad._hp_error, KeyError)
