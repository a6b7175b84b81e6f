"""The lean engine on CUDA (marked `gpu`, skipped without it): CUDA graphs, the static cache and the
one-launch layer kernel, for all six families, against the unmodified transformers model; graphs
against the same engine run eagerly; and upper's decode with no host step. The CPU twins of these
checks are in test_lean.py."""

from __future__ import annotations

import pytest
import torch

from cmoe.executor.run import ExecConfig, execute, prepare
from cmoe.policy.policies import POLICIES, trait

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXACT = [p for p in POLICIES if not trait(p, "skips") and p != "oracle"]


def _run(model_dir, policies, graphs=True, fmt="w4g32", tokens=5, batch=2, slots=3, keep_logits=True):
    cfg = ExecConfig(policies=tuple(policies), slots=slots, batch=batch, tokens=tokens, device="cuda", quant=fmt,
                     keep_logits=keep_logits, record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=model_dir, trace_src=None, data=None, cfg=cfg)
    if not graphs:
        import cmoe.executor.lean as lean
        orig = lean.LeanEngine.__init__

        def no_graphs(self, *a, **k):
            orig(self, *a, **k)
            self.use_graphs = False
        lean.LeanEngine.__init__ = no_graphs
        try:
            return w, execute(w, cfg)
        finally:
            lean.LeanEngine.__init__ = orig
    return w, execute(w, cfg)


def _teacher_logits(model_dir, prompts, fed, group):
    """The unmodified model (fp32, experts dequantized as cmoe quantizes them) fed the tokens the
    engine chose, so the comparison never forks."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from tests.test_executor import _dequantize_experts, left_padded
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _dequantize_experts(group)(ref)
    ref = ref.cuda()
    ids, mask, pos = left_padded(prompts)
    B = len(prompts)
    ids, mask, pos = ids.cuda(), mask.cuda(), pos.cuda()
    cache = DynamicCache(config=ref.config)
    out = []
    with torch.no_grad():
        lg = ref(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(lg.cpu())
        for nxt in fed:
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device="cuda")], 1)
            pos = pos[:, -1:] + 1
            lg = ref(input_ids=nxt.cuda(), attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[:, -1]
            out.append(lg.cpu())
    return out


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _same_decisions(runs_a, runs_b) -> None:
    """Two runs of the same policies: the same plans, and logits that agree up to the expert
    kernel's fp32 atomics (any two runs do)."""
    assert [r.policy for r in runs_a] == [r.policy for r in runs_b]
    for a, b in zip(runs_a, runs_b):
        assert [p.loads for p in a.log.plans] == [p.loads for p in b.log.plans], a.policy
        for x, y in zip(a.logits, b.logits):
            assert _rel(x, y) < 1e-2, a.policy


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_lean_graphs_match_transformers(fused_checkpoints, family):
    """Every exact policy, graphs and the Triton layer kernel, bf16 on the GPU: each pass's logits
    within bf16 tolerance of the fp32 model fed the same tokens; no slot ever holds wrong bytes."""
    w, results = _run(fused_checkpoints[family], EXACT)
    assert w.store.packing == "tiled"
    for r in results:
        fed = [lg.argmax(-1, keepdim=True) for lg in r.logits[:-1]]
        ref = _teacher_logits(fused_checkpoints[family], w.prompts, fed, 32)
        for i, (a, b) in enumerate(zip(r.logits, ref)):
            assert _rel(a, b) < 3e-2, (r.policy, i, _rel(a, b))
        assert r.log.slot_mismatches == 0
        assert r.log.capture_us is not None and r.log.capture_us > 0


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_lean_graph_replay_equals_eager(fused_checkpoints, family):
    """The same engine with and without graphs: the same decisions, the same logits up to the
    kernel's fp32 atomics."""
    pols = ["upper", "ondemand", "commit", "static", "adaptive-ahead", "commit-ahead"]
    _, g = _run(fused_checkpoints[family], pols)
    _, e = _run(fused_checkpoints[family], pols, graphs=False)
    _same_decisions(g, e)


def test_lean_upper_decodes_without_host_waits(fused_checkpoints):
    """upper's decode passes have no read-back: no host_sync span and no route planning span."""
    _, (r,) = _run(fused_checkpoints["mixtral"], ["upper"], tokens=6)
    dec = {p for p, d, _, _ in r.log.pass_us if d}
    ops = {s[4] for s in r.log.spans if s[1] in dec and s[3] == "host"}
    assert "host_sync" not in ops and "host_route" not in ops
    assert r.metrics["loads"] == 0 and r.metrics["hits"] > 0 and r.metrics["late"] == r.metrics["demand"] == 0


def test_lean_queued_passes_decide_as_synced_ones(fused_checkpoints, monkeypatch):
    """Graphed decode passes queued back to back (the default: the host prepares the next pass
    while the GPU finishes this one) against passes with a sync at each end (CMOE_PASS_SYNC=1):
    the same plans, no slot ever read with wrong bytes, the same hits, and every pass timed. No
    logits kept, so nothing else syncs between the passes."""
    pols = ["upper", "ondemand", "commit", "lfu-fallback", "adaptive-ahead"]
    runs, syncs = {}, {}
    real = torch.cuda.synchronize

    def counted(*a, **k):
        syncs[sync] = syncs.get(sync, 0) + 1
        return real(*a, **k)
    monkeypatch.setattr(torch.cuda, "synchronize", counted)
    from cmoe.executor.cuda_rt import Runtime
    memsets, memset2d = [], Runtime.memset2d
    monkeypatch.setattr(Runtime, "memset2d", lambda self, *a: memsets.append(a) or memset2d(self, *a))
    monkeypatch.delenv("CMOE_DEVICE_STEP", raising=False)
    for sync in ("0", "1"):
        monkeypatch.setenv("CMOE_PASS_SYNC", sync)
        _, runs[sync] = _run(fused_checkpoints["mixtral"], pols, tokens=8, keep_logits=False)
    # per policy, 8 decode passes: synced, a device sync at the start of each; queued, one at the
    # first (its capture) and one at close (the last pass still queued). On the H200: 129 and 99
    assert syncs["1"] - syncs["0"] == (8 - 2) * len(pols), syncs
    # each graphed pass's inputs by the runtime (`pass_inputs`): one memset of the mask column each
    assert Runtime.get() is None or len(memsets) >= 2 * 7 * len(pols), len(memsets)
    for a, b in zip(runs["0"], runs["1"]):
        assert [p.loads for p in a.log.plans] == [p.loads for p in b.log.plans], a.policy
        assert a.log.slot_mismatches == 0 and b.log.slot_mismatches == 0, a.policy
        assert a.metrics["hits"] == b.metrics["hits"] and a.metrics["loads"] == b.metrics["loads"], a.policy
        assert len(a.log.pass_us) == len(b.log.pass_us) == 9 and all(us > 0 for *_, us in a.log.pass_us)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_lean_layer_step_only_where_the_decoder_is_the_plain_one(fused_checkpoints, family, monkeypatch):
    """`_moe_decoder`: the families with the plain pre-norm decoder layer take the one-launch add and
    norm, once per MoE layer each time a pass runs in Python (prefill, the decode graph's warm-up
    and capture, eager passes); DeepSeek's (MLA attention) keeps transformers' forward, and so does
    CMOE_LEAN_LAYER=0. With and without it the logits agree to the norm's sum order."""
    from cmoe.executor.kernels_triton import norm
    calls = []
    real = norm.add_rms_norm
    monkeypatch.setattr(norm, "add_rms_norm", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CMOE_LEAN_LAYER", flag)
        calls.clear()
        w, (out[flag],) = _run(fused_checkpoints[family], ["upper"], tokens=4)
        if flag == "0" or family.startswith("deepseek"):
            assert calls == []
        else:
            assert calls and len(calls) % w.spec.num_moe_layers == 0, len(calls)
    for x, y in zip(out["1"].logits, out["0"].logits):
        assert _rel(x, y) < 1e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_lean_qkv_gemv_with_the_input_norm(fused_checkpoints, family, monkeypatch):
    """CMOE_QKV_NORM=1 at batch 1: each MoE layer's input norm is folded into the q/k/v GEMV in the
    decode passes (one call a layer a pass that runs in Python: warm-up, capture) and nowhere else;
    the plans are those without it and the logits agree to the norm's sum order."""
    from cmoe.executor.kernels_triton import gemv as G
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **k: (calls.append(k.get("norm") is not None), real(*a, **k))[1])
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CMOE_QKV_NORM", flag)
        calls.clear()
        w, out[flag] = _run(fused_checkpoints[family], ["upper", "commit"], tokens=4, batch=1)
        folded = sum(calls)
        if flag == "0":
            assert folded == 0
        else:
            assert folded and folded % w.spec.num_moe_layers == 0, (folded, w.spec.num_moe_layers)
    _same_decisions(out["1"], out["0"])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lean_early_launched_gemv_changes_no_decision(fused_checkpoints, family, monkeypatch):
    """CMOE_PDL=1: the projections start while the kernel ahead ends (in the graphs too); the plans
    are those without it and the logits agree up to the expert kernel's fp32 atomics."""
    from cmoe.executor.kernels_triton import gemv as G
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90")
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CMOE_PDL", flag)
        assert G.pdl_enabled(torch.device("cuda")) == (flag == "1")
        _, out[flag] = _run(fused_checkpoints[family], ["upper", "commit"], tokens=5)
    _same_decisions(out["1"], out["0"])


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "qwen3_moe"])
def test_lean_slot_stepped_on_the_device_as_copied_in(fused_checkpoints, family, monkeypatch):
    """P's graph moves the cache's slot and mask column on the device (CMOE_DEVICE_STEP=1), against the
    slot copied in from pinned memory and the column set by a memset (the default): the same
    plans, logits agreeing up to the expert kernel's fp32 atomics, the memsets only where copied in,
    and the caches left alike."""
    from cmoe.executor import run as R
    from cmoe.executor.cuda_rt import Runtime
    memsets, memset2d, new_cache = [], Runtime.memset2d, R.new_cache
    monkeypatch.setattr(Runtime, "memset2d", lambda self, *a: memsets.append(a) or memset2d(self, *a))
    caches = []
    monkeypatch.setattr(R, "new_cache", lambda *a: caches.append(new_cache(*a)) or caches[-1])
    out, count, pols = {}, {}, ["upper", "ondemand", "commit"]
    for flag in ("1", "0"):
        monkeypatch.setenv("CMOE_DEVICE_STEP", flag)
        n = len(memsets)
        _, out[flag] = _run(fused_checkpoints[family], pols, tokens=6)
        count[flag] = len(memsets) - n
    _same_decisions(out["1"], out["0"])
    # stepped, no pass sets its mask column from the host; copied in, every graphed decode pass does
    assert count["1"] == 0 and (Runtime.get() is None or count["0"] >= 5 * len(pols)), count
    # the caches each way alike at the end: the slot last written, the mask, the count (the engine's
    # `check_device_steps` passed at finish in the stepped runs)
    for a, b in zip(caches[:len(pols)], caches[len(pols):]):
        assert a.length == b.length and a.slots.item() == b.slots.item() == a.length - 1
        assert torch.equal(a.valid, b.valid)


@pytest.fixture(scope="module")
def fused_trace(fused_checkpoints, tmp_path_factory):
    """A synthetic trace with the tiny fused Mixtral's shapes, for replayed runs."""
    from cmoe.core.quant import recipe
    from cmoe.core.spec import from_checkpoint
    from cmoe.trace import bundle
    from cmoe.trace.synthetic import SyntheticParams, generate
    t = generate(from_checkpoint(fused_checkpoints["mixtral"]), recipe("w4g32"),
                 SyntheticParams(requests=2, prompt_len=6, decode_len=10, pred_acc=0.6, seed=1))
    return bundle.write(t, tmp_path_factory.mktemp("ftr") / "tiny")


@pytest.mark.parametrize("slots", [2, 3])
def test_host_program_runs_as_the_python_step(fused_checkpoints, fused_trace, slots, monkeypatch):
    """A replayed run's graphed decode passes through the compiled host program against the Python
    step (CMOE_HOST_PROGRAM=0): the same plans (needs, loads, GPU experts, skips, the slots after
    each step), the same loads and spans per pass, layer and kind, the same occupancy, no slot
    read with wrong bytes, logits equal up to the kernel's fp32 atomics. Two slots a block at
    batch 2 and top-2 make layers run in launch waves. The CPU-expert policies too: the program
    calls back for their CPU work (`_cpu_step`), the same experts falling back."""
    from collections import Counter
    pols = ("ondemand", "lru-prefetch", "oracle", "adaptive", "commit", "adaptive-ahead", "commit-ahead",
            "lfu-fallback", "static")
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("CMOE_HOST_PROGRAM", flag)
        cfg = ExecConfig(policies=pols, slots=slots, batch=2, tokens=8, device="cuda", quant="w4g32",
                         keep_logits=True, record_plans=True)
        w, cfg = prepare(spec_name=None, model_dir=fused_checkpoints["mixtral"], trace_src=str(fused_trace), data=None,
                         cfg=cfg)
        runs[flag] = execute(w, cfg)
    kinds = lambda r: Counter((s[1], s[2], s[3], s[4], s[5]) for s in r.log.spans)
    for a, b in zip(runs["0"], runs["1"]):
        assert not a.log.host_program and b.log.host_program, a.policy
        assert a.log.plans == b.log.plans, a.policy
        assert a.log.slot_mismatches == b.log.slot_mismatches == 0, a.policy
        assert a.log.occupancy == b.log.occupancy, a.policy
        assert {p: (c.loads, c.bytes_moved, c.skipped, c.fallbacks) for p, c in a.log.per_pass.items()} == \
            {p: (c.loads, c.bytes_moved, c.skipped, c.fallbacks) for p, c in b.log.per_pass.items()}, a.policy
        assert kinds(a) == kinds(b), a.policy
        ma, mb = a.metrics, b.metrics                     # hit or late: a matter of timing
        assert (ma["demand"], ma["hits"] + ma["late"]) == (mb["demand"], mb["hits"] + mb["late"]), a.policy
        for x, y in zip(a.logits, b.logits):
            assert _rel(x, y) < 1e-2, a.policy
    assert any(p.layer >= 0 and len(p.loads) for r in runs["1"] for p in r.log.plans)
    assert all(any(p.cpu for p in r.log.plans if p.pass_index > 0)
               for r in runs["1"] if r.policy in ("lfu-fallback", "static"))


class _Counted:
    """A captured graph whose replays from Python are counted by its name (the host program launches
    the executable, `raw_cuda_graph_exec`, itself)."""

    def __init__(self, graph, name: str, counts: dict):
        self.graph, self.name, self.counts = graph, name, counts

    def replay(self):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.graph.replay()

    def __getattr__(self, attr):
        return getattr(self.graph, attr)


@pytest.mark.parametrize("program,few", [("0", 1), ("0", 2), ("1", 2)])
def test_few_expert_graphs_change_no_decision(fused_checkpoints, fused_trace, program, few, monkeypatch):
    """Launches naming few experts replay twins of the layer's graphs captured on the few-expert
    kernel configuration (`few_experts`; here up to `few` experts at batch 2, two slots a block, so
    layers run in one-expert waves and, with two, whole steps of two), by the Python step and by the
    host program, switched on (CMOE_FEW_EXPERTS=on) against off (=0): the same plans, loads and
    occupancy, no slot read with wrong bytes, logits equal up to the kernel's fp32 atomics; the
    Python step replayed the twins it should."""
    from cmoe.executor import few_experts
    from cmoe.executor.lean_program import Segments
    monkeypatch.setitem(few_experts.FEW_EXPERTS, 2, few)
    monkeypatch.setenv("CMOE_HOST_PROGRAM", program)
    captured, capture, counts = [], Segments._capture, {}

    def seen(self, B):
        capture(self, B)
        captured.append((flag, self._few_max, tuple(sorted({k[0] for k in self.graphs if k[0].endswith("-few")}))))
        for k in [k for k in self.graphs if k[0].endswith("-few")]:
            self.graphs[k] = _Counted(self.graphs[k], k[0], counts)
    monkeypatch.setattr(Segments, "_capture", seen)
    runs, pols = {}, ("ondemand", "lru-prefetch", "lfu-fallback")
    for flag in ("0", "on"):
        monkeypatch.setenv("CMOE_FEW_EXPERTS", flag)
        cfg = ExecConfig(policies=pols, slots=2, batch=2, tokens=8, device="cuda", quant="w4g32",
                         keep_logits=True, record_plans=True)
        w, cfg = prepare(spec_name=None, model_dir=fused_checkpoints["mixtral"], trace_src=str(fused_trace), data=None,
                         cfg=cfg)
        runs[flag] = execute(w, cfg)
    assert {c[0] for c in captured} == {"0", "on"}
    assert set(captured) == {("0", 0, ()), ("on", few, ("experts-few", "wave-few"))}
    if program == "0":
        assert counts.get("wave-few", 0) > 0 and (counts.get("experts-few", 0) > 0) == (few == 2), counts
    for a, b in zip(runs["0"], runs["on"]):
        assert a.log.host_program == b.log.host_program == (program == "1"), a.policy
        assert a.log.plans == b.log.plans and a.log.occupancy == b.log.occupancy, a.policy
        assert a.log.slot_mismatches == b.log.slot_mismatches == 0, a.policy
        for x, y in zip(a.logits, b.logits):
            assert _rel(x, y) < 1e-2, a.policy


@pytest.mark.parametrize("slots,batch", [(2, 2), (3, 2), (3, 1)])
def test_host_program_plans_a_live_run_as_the_python_step(fused_checkpoints, slots, batch, monkeypatch):
    """No trace: every decode pass planned from its read-backs (`host_live`) by the program and by
    the Python step, teacher-forced so both feed the same tokens. The same plans (the needs and
    predictions the two ranked; commit's committed sets, drawn from each row's prediction), loads,
    skips and occupancy, logits equal up to fp32 atomics."""
    pols = ("ondemand", "lru-prefetch", "adaptive", "commit")
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("CMOE_HOST_PROGRAM", flag)
        cfg = ExecConfig(policies=pols, slots=slots, batch=batch, tokens=8, device="cuda", quant="w4g32",
                         keep_logits=True, record_plans=True, teacher=(5, 9, 2, 7, 11, 3, 8, 1))
        w, cfg = prepare(spec_name=None, model_dir=fused_checkpoints["mixtral"], trace_src=None, data=None, cfg=cfg)
        runs[flag] = execute(w, cfg)
    for a, b in zip(runs["0"], runs["1"]):
        assert not a.log.host_program and b.log.host_program, a.policy
        assert a.log.plans == b.log.plans, a.policy
        assert a.log.slot_mismatches == b.log.slot_mismatches == 0, a.policy
        assert a.log.occupancy == b.log.occupancy, a.policy
        assert {p: (c.loads, c.skipped) for p, c in a.log.per_pass.items()} == \
            {p: (c.loads, c.skipped) for p, c in b.log.per_pass.items()}, a.policy
        for x, y in zip(a.logits, b.logits):
            assert _rel(x, y) < 1e-2, a.policy
    assert any(p.layer >= 0 and p.pass_index > 0 and len(p.loads) for r in runs["1"] for p in r.log.plans)
