"""The executor on CPU: int4 layouts and kernels, logits against unmodified transformers models,
commit with OWA checked by hand, pool bookkeeping against the pure policy replay, the measured
timeline's ordering, and the one-line errors. GPU twins of these run with CUDA (marked `gpu`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cmoe.core.errors import CmoeError
from cmoe.executor.kernels import ExpertViews, dequantize, expert_bytes_of, ffn, int4_mm, pack_cpu, quantize
from cmoe.executor.layout import expert_layout, slot_size
from cmoe.executor.run import ExecConfig, execute, prepare
from cmoe.policy.policies import POLICIES, trait, make_policy
from cmoe.trace.passes import ranked
from cmoe.core.quant import expert_tensor_bytes
from cmoe.core.spec import from_checkpoint, preset

EXACT = [p for p in POLICIES if not trait(p, "skips") and p != "oracle"]      # oracle needs a replayed trace


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and positions of a left-padded batch, as the executor builds them."""
    B, L = len(prompts), max(map(len, prompts))
    ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, q in enumerate(prompts):
        ids[b, L - len(q):] = torch.tensor(q)
        mask[b, L - len(q):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def reference_logits(model_dir, prompts: list[list[int]], steps: int, replace_experts=None) -> list[torch.Tensor]:
    """The unmodified transformers model, run the way the executor runs it: left padding,
    positions from the mask, greedy decoding with a KV cache; last-position logits per pass."""
    from transformers import AutoModelForCausalLM, DynamicCache
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if replace_experts is not None:
        replace_experts(ref)
    ids, mask, pos = left_padded(prompts)
    B = len(prompts)
    cache = DynamicCache(config=ref.config)
    out = []
    with torch.no_grad():
        lg = ref(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(lg)
        for _ in range(steps):
            nxt = lg.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            lg = ref(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[:, -1]
            out.append(lg)
    return out


def run_exec(model_dir, policies, fmt="fp32", batch=2, tokens=4, slots=None, **kw):
    spec = from_checkpoint(model_dir)
    slots = spec.top_k + 1 if slots is None else slots
    cfg = ExecConfig(policies=tuple(policies), slots=slots, pool_gb=1.0, batch=batch, tokens=tokens, device="cpu", quant=fmt,
                     keep_logits=True, record_plans=True, **kw)
    w, cfg = prepare(spec_name=None, model_dir=model_dir, trace_src=None, data=None, cfg=cfg)
    return w, execute(w, cfg)


def run_exec_cuda(model_dir, policies=("upper", "ondemand", "static")):
    """The executor on CUDA over a checkpoint whose experts run as stored (its own format)."""
    cfg = ExecConfig(policies=tuple(policies), slots=3, batch=2, tokens=4, device="cuda", keep_logits=True,
                     record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=model_dir, trace_src=None, data=None, cfg=cfg)
    return w, execute(w, cfg)


def assert_prefill_matches(results, prompts, model_dir, replace_experts) -> None:
    """Each run's prefill logits (bf16 on the GPU) against the fp32 transformers model whose experts
    `replace_experts` set; no slot mismatch; `static` fell back at least once."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replace_experts(ref)
    ids, mask, pos = left_padded(prompts)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    for r in results:
        assert ((r.logits[0].float().cpu() - want).norm() / want.norm()).item() < 3e-2, r.policy
        assert r.log.slot_mismatches == 0
    assert {r.policy: r.metrics for r in results}["static"]["fallbacks"] > 0


# --- int4 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(128, 64), (64, 256), (256, 128), (96, 128), (32, 64)])
def test_cpu_kernel_reads_what_pack_cpu_writes(shape):
    """On whatever CPU runs the test (AVX2 or AVX-512 lay the bytes out differently): the kernel
    on pack_cpu's bytes computes x @ W^T for the codes' own dequantized W, to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, shape, dtype=torch.int32, generator=g)
    sz = torch.stack([torch.rand(shape[1] // 32, shape[0], generator=g) * 0.01 + 0.001,
                      torch.rand(shape[1] // 32, shape[0], generator=g) - 0.5], -1).to(torch.bfloat16)
    x = torch.randn(3, shape[1], generator=g)
    ref = x.double() @ dequantize(codes, sz, 32).double().T
    y = int4_mm(x, pack_cpu(codes), 32, sz).double()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_int4_kernel_computes_the_dequantized_matrix():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=g)
    codes, sz = quantize(w, 32)
    ref_w = dequantize(codes, sz, 32)
    x = torch.randn(5, 256, generator=g)
    y = int4_mm(x, pack_cpu(codes), 32, sz)
    ref = x.double() @ ref_w.double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5       # same function, fp32 arithmetic
    # quantization error itself: 4 bits, groups of 32, asymmetric -> a few percent of the weights' norm
    q_err = ((ref_w - w).norm() / w.norm()).item()
    assert 0.03 < q_err < 0.12


def test_expert_layout_bytes_equal_the_recipe_bytes():
    mix = preset("mixtral-8x7b")
    for fmt in ("w4g128", "bf16"):
        lay = expert_layout(fmt, mix.hidden, mix.expert_ffn)
        assert lay.nbytes == sum(expert_tensor_bytes(mix, fmt).values())
    assert expert_layout("w4g128", 4096, 14336).nbytes == 93_585_408
    with pytest.raises(CmoeError, match="executor runs experts as"):
        expert_layout("w3g128", 4096, 14336)
    with pytest.raises(CmoeError, match="divisible"):
        expert_layout("w4g128", 32, 48)


def test_slot_views_run_the_packed_expert():
    lay = expert_layout("w4g32", 64, 64)
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(128, 64, generator=g), torch.randn(64, 64, generator=g)
    buf = torch.zeros(slot_size(lay), dtype=torch.uint8)
    expert_bytes_of(lay, w13, w2, "cpu", buf)
    v = ExpertViews(lay, buf, "cpu")
    x = torch.randn(3, 64, generator=g)
    d13 = dequantize(*quantize(w13, 32), 32)
    d2 = dequantize(*quantize(w2, 32), 32)
    a, b = (x @ d13.T).chunk(2, -1)
    ref = (torch.nn.functional.silu(a) * b) @ d2.T
    assert torch.allclose(ffn(x, v), ref, rtol=1e-4, atol=1e-5)


# --- logits against transformers -----------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_exact_policies_reproduce_transformers_logits(checkpoints, family):
    """fp32 experts, a pool of top_k+1 slots per block, batch 2 with left padding: every exact
    policy gives the unmodified model's logits (float32, summation order aside: 1e-5)."""
    w, results = run_exec(checkpoints[family], EXACT)
    ref = reference_logits(checkpoints[family], w.prompts, 4)
    for r in results:
        assert len(r.logits) == len(ref) == 5
        for a, b in zip(r.logits, ref):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (r.policy, (a - b).abs().max().item())
    m = {r.policy: r.metrics for r in results}
    assert m["ondemand"]["loads"] > 0 and m["upper"]["loads"] == 0
    assert m["static"]["fallbacks"] > 0 and m["static"]["loads"] == 0
    assert m["upper"]["experts_fit"] == w.spec.num_experts * w.spec.num_moe_layers


def _dequantize_experts(group: int):
    def apply(model):
        with torch.no_grad():
            for layer in model.model.layers:
                if not hasattr(layer.mlp, "experts"):          # a dense layer
                    continue
                ex = layer.mlp.experts
                for e in range(ex.gate_up_proj.shape[0]):
                    ex.gate_up_proj[e] = dequantize(*quantize(ex.gate_up_proj[e], group), group)
                    ex.down_proj[e] = dequantize(*quantize(ex.down_proj[e], group), group)
    return apply


def test_int4_experts_match_the_dequantized_model_and_stay_near_the_float_one(int4_checkpoint):
    w, results = run_exec(int4_checkpoint, ["upper", "ondemand", "lfu-fallback"], fmt="w4g32")
    deq = reference_logits(int4_checkpoint, w.prompts, 4, _dequantize_experts(32))
    flt = reference_logits(int4_checkpoint, w.prompts, 4)
    for r in results:
        for a, b in zip(r.logits, deq):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (r.policy, (a - b).abs().max().item())
    # against the float model on the same input (the prefill; greedy steps may pick other tokens
    # afterwards): the quantization tolerance, relative L2 error of the logits
    a, b = results[0].logits[0], flt[0]
    err = ((a - b).norm() / b.norm()).item()
    assert err < 0.05


# --- commit and OWA -----------------------------------------------------------------------------

def _engine(model_dir, policy_name: str, slots: int):
    from cmoe.executor.engine import Engine
    from cmoe.executor.run import build, layout_for
    spec = from_checkpoint(model_dir)
    cfg = ExecConfig(policies=(policy_name,), slots=slots, batch=1, tokens=4, device="cpu", quant="fp32")
    w, cfg = prepare(spec_name=None, model_dir=model_dir, trace_src=None, data=None, cfg=cfg)
    build(w, cfg)
    layout, _ = layout_for(w, cfg, policy_name)
    pol = make_policy(policy_name, layout, spec.num_experts, [[0] * spec.num_experts] * spec.num_moe_layers)
    return Engine(w.model, w.shims, spec, w.store, pol, w.device), w


def _expert_ref(model_dir, spec, m: int, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of MoE layer m straight from the checkpoint's float weights."""
    from safetensors.torch import load_file
    sd = load_file(str(model_dir / "model.safetensors"))
    d = spec.moe_layers[m]
    p = f"model.layers.{d}.block_sparse_moe.experts.{e}."
    w1, w3, w2 = sd[p + "w1.weight"], sd[p + "w3.weight"], sd[p + "w2.weight"]
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _moe_call(eng, m: int, x, true_experts, pred_experts, logits):
    """Drive one decode MoE layer of the engine by hand, as the model's forward would."""
    from cmoe.executor.records import PassInput
    eng.cur = PassInput(0, True, torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long),
                        None, np.ones(1, bool))
    eng.logits = [None] * eng.M
    eng.pred_gpu = [None] * eng.M
    eng.token_pred = [None] * eng.M
    eng.last = eng.clock.mark()
    eng.h_last = eng.clock.host()
    eng.logits[m] = torch.tensor([logits], dtype=torch.float32)
    eng.token_pred[m] = [list(pred_experts)]
    eng._layer = -1
    eng._issue(eng.policy.begin_pass(True, list(pred_experts)) if m == 0 else [], set())
    eng.begun = True
    s = torch.softmax(torch.tensor(logits), -1)
    top = torch.topk(s, 2)
    w = (top.values / top.values.sum())[None]
    assert top.indices.tolist() == list(true_experts)
    return eng.moe_layer(m, x, top.indices[None], w)


def test_commit_owa_weights_by_hand(checkpoints):
    """Layer 0, one token. True top-2 = {0, 1} (logits 2, 1, 0, -1); committed = {0, 2}.
    softmax restricted to {0, 2}: w0 = e^2 / (e^2 + e^0) = 0.880797, w2 = 0.119203; expert 1 is skipped."""
    eng, w = _engine(checkpoints["mixtral"], "commit", slots=2)
    x = torch.randn(1, w.spec.hidden, generator=torch.Generator().manual_seed(7))
    out = _moe_call(eng, 0, x, (0, 1), (0, 2), [2.0, 1.0, 0.0, -1.0])
    w0 = math.exp(2) / (math.exp(2) + math.exp(0))
    assert abs(w0 - 0.880797) < 1e-6
    ref = w0 * _expert_ref(checkpoints["mixtral"], w.spec, 0, 0, x) + (1 - w0) * _expert_ref(checkpoints["mixtral"], w.spec, 0, 2, x)
    assert torch.allclose(out, ref, atol=1e-6)
    eng._resolve(final=True)
    assert eng.log.skipped == 1 and eng.log.gpu_experts == 2
    eng.close()


def test_commit_with_a_right_prediction_is_exact(checkpoints):
    eng, w = _engine(checkpoints["mixtral"], "commit", slots=2)
    x = torch.randn(1, w.spec.hidden, generator=torch.Generator().manual_seed(8))
    logits = [0.3, -0.2, 1.4, 0.9]                   # top-2 = (2, 3)
    out = _moe_call(eng, 0, x, (2, 3), (2, 3), logits)
    s = torch.softmax(torch.tensor(logits), -1)
    w2, w3 = s[2] / (s[2] + s[3]), s[3] / (s[2] + s[3])
    ref = w2 * _expert_ref(checkpoints["mixtral"], w.spec, 0, 2, x) + w3 * _expert_ref(checkpoints["mixtral"], w.spec, 0, 3, x)
    assert torch.allclose(out, ref, atol=1e-6)
    assert eng.log.skipped == 0
    eng.close()


def _scaled_checkpoint(src, dst, scale: float):
    """The tiny Mixtral with attention and expert outputs scaled: at small scales the hidden state,
    and so the routing, changes little from layer to layer and the commit prediction is right; at
    large ones it is not."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.experts.down_proj.mul_(scale)
    model.save_pretrained(dst)
    return dst


def test_commit_matches_exact_routing_wherever_the_prediction_was_right(checkpoints, tmp_path):
    """Batch 1: a decode pass whose every layer committed exactly the routed experts gives the
    exact logits, as long as every earlier pass did too (the KV cache is then exact); the first
    pass with a miss differs. The two models exercise both sides."""
    seen = set()
    for scale in (2.0, 5.0):
        path = _scaled_checkpoint(checkpoints["mixtral"], tmp_path / f"s{scale}", scale)
        w, (up, com) = run_exec(path, ["upper", "commit"], batch=1, tokens=6, slots=2)
        right: dict[int, bool] = {}
        for p in com.log.plans:
            if p.layer >= 0:
                right[p.pass_index] = right.get(p.pass_index, True) and not p.skipped and len(p.gpu) == len(p.needed)
        assert right[0]                                   # prefill is exact for commit
        prefix = next((i for i in range(len(com.logits)) if not right[i]), len(com.logits))
        for i in range(prefix):
            assert torch.allclose(com.logits[i], up.logits[i], atol=1e-5)
        if prefix < len(com.logits):
            assert not torch.allclose(com.logits[prefix], up.logits[prefix], atol=1e-3)
            seen.add("miss")
        else:
            seen.add("all right")
    assert seen == {"miss", "all right"}


# --- the pool against the policy, step for step ---------------------------------------------------

# the policies that load when a pass begins; the others' records of a pass's start have no loads
BEGIN_LOADS = ("commit", "commit-ahead", "oracle", "adaptive-ahead")


def _pure_replay(trace_path, policy_name, layout, batch, tokens):
    """The decisions of the policy alone, driven by the trace's passes as the simulator drives it."""
    from cmoe.trace import bundle
    from cmoe.trace.passes import make_passes, popularity
    t = bundle.read(trace_path)
    passes = make_passes(t, batch, groups=1, decode_steps=tokens)
    pol = make_policy(policy_name, layout, t.spec.num_experts, popularity(t), [ps.needed for ps in passes])
    out = []
    M = t.spec.num_moe_layers
    for ps in passes:
        deep = (lambda q: {"ahead": ps.seen(q, pol.depth)}) if pol.depth > 1 else (lambda q: {})
        out.append((ps.index, -1, (), tuple((ld.layer, ld.expert, ld.slot, ld.victim, ld.kind)
                                             for ld in pol.begin_pass(ps.decode, list(ps.predicted[0]), **deep(0))), (), (), ()))
        for m in range(M):
            p = pol.plan(m, list(ps.needed[m]), list(ps.predicted[m + 1]) if m + 1 < M else None, **deep(m + 1))
            out.append((ps.index, m, ps.needed[m], tuple((ld.layer, ld.expert, ld.slot, ld.victim, ld.kind)
                                                         for ld in p.loads), tuple(p.gpu), tuple(p.cpu), tuple(p.skipped)))
    return out


@pytest.mark.parametrize("batch", [1, 2])
def test_pool_bookkeeping_matches_the_policy_step_for_step(checkpoints, tiny_trace, batch):
    cfg = ExecConfig(policies=POLICIES, slots=2, batch=batch, tokens=8, device="cpu", quant="fp32", record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    results = execute(w, cfg)
    for r in results:
        got = [(p.pass_index, p.layer, p.needed, p.loads, p.gpu, p.cpu, p.skipped) for p in r.log.plans]
        want = _pure_replay(tiny_trace, r.policy, r.layout, batch, 8)
        if r.policy not in BEGIN_LOADS:
            got = [g if g[1] >= 0 else g[:3] + ((),) + g[4:] for g in got]
        assert got == want, r.policy
        assert all(p.physical == p.logical for p in r.log.plans if p.layer >= 0), r.policy
        assert r.log.slot_mismatches == 0, r.policy
        assert r.metrics["decode_tokens"] == 8 * batch
    loads = {r.policy: r.metrics["loads"] for r in results}
    assert loads["upper"] == loads["static"] == 0 and loads["ondemand"] > 0 and loads["commit"] > 0


def test_measured_timeline_orders_loads_before_reads(checkpoints, tiny_trace):
    """Every expert kernel starts after the load that brought it; every load starts after the last
    read of the slot's previous expert ended. On the CPU the copies are synchronous, so what this
    checks here is the engine's issue order (which plan step each span belongs to) and the host
    lane; the same check runs on CUDA events, where the order is the streams', in the GPU test."""
    from cmoe.core.timeline import COLUMNS
    cfg = ExecConfig(policies=("ondemand", "commit"), slots=2, batch=1, tokens=8, device="cpu", quant="fp32",
                     record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    for r in execute(w, cfg):
        check_timeline(r)
        check_host_lane(r, w.spec)
        assert {s[0] for s in r.log.spans} == {"cpu"}
        assert all(len(s) == len(COLUMNS) for s in r.log.spans)


def check_host_lane(r, spec) -> None:
    """The host thread's own spans: one attention, sync and route per pass and MoE layer, one head
    per pass, one issue span per expert kernel that encloses it (on the CPU the marks are the
    host's clock), and the early router for every predicted layer of commit's decode passes. The
    lean engine's commit also waits at each decode pass's start for its layer-0 prediction: one
    more sync, and the first layer's attention span cut in two around it."""
    spans = r.log.spans
    host = [s for s in spans if s[3] == "host"]
    n_pass, M = len(r.log.pass_us), spec.num_moe_layers
    starts = sum(d for _, d, _, _ in r.log.pass_us) if r.policy == "commit" and r.metrics["engine"] == "lean" else 0
    count = {op: sum(1 for s in host if s[4] == op) for op in ("host_attention", "host_sync", "host_route", "host_head")}
    assert count == {"host_attention": n_pass * M + starts, "host_sync": n_pass * M + starts, "host_route": n_pass * M,
                     "host_head": n_pass}
    issue = sorted((s for s in host if s[4] == "host_expert"), key=lambda s: s[6])
    kernels = sorted((s for s in spans if s[4] == "expert"), key=lambda s: s[6])
    assert len(issue) == len(kernels)
    for h, k in zip(issue, kernels):
        assert (h[1], h[2], h[5]) == (k[1], k[2], k[5]) and h[6] <= k[6] and k[7] <= h[7]
    predicted = sum(1 for s in host if s[4] == "host_predict")
    decodes = sum(1 for _, d, _, _ in r.log.pass_us if d)
    assert predicted == (decodes * M + (n_pass - decodes) * (M - 1) if r.policy == "commit" else 0)


def check_timeline(r) -> None:
    """Replays the plan records against the timeline: loads and reads of each slot alternate in
    time as the plans ordered them."""
    spans = r.log.spans
    assert all(s[7] >= s[6] for s in spans)
    loads = [s for s in spans if s[4] == "load"]
    experts = [s for s in spans if s[4] == "expert"]
    assert len(loads) == r.log.loads == r.metrics["loads"] + r.metrics["prefill_loads"]
    for ld in loads:
        # the next kernel of that expert in that layer starts after the load ended
        later = [e for e in experts if e[2] == ld[2] and e[5] == ld[5] and e[1] >= ld[1] and e[6] >= ld[6]]
        if later:
            assert min(later, key=lambda e: e[6])[6] >= ld[7] - 1e-3
    assert max(s[7] for s in spans) > 0


# --- errors and the command line -----------------------------------------------------------------

def test_gpu_memory_check_names_the_fix():
    from cmoe.executor.run import check_gpu_fits
    check_gpu_fits({"commit": 19 * 10**9}, 20, 139 * 10**9, "NVIDIA H200")
    with pytest.raises(CmoeError, match="a 200 GB pool does not fit the 139.0 GB free on the NVIDIA H200: lower --pool-gb"):
        check_gpu_fits({"commit": 10**9}, 200, 139 * 10**9, "NVIDIA H200")
    with pytest.raises(CmoeError, match="policy upper needs 150.0 GB"):
        check_gpu_fits({"upper": 150 * 10**9}, 20, 139 * 10**9, "NVIDIA H200")


def _cli(*args):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    return CliRunner().invoke(app, list(args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_with_device_cuda_is_one_line():
    r = _cli("execute", "--spec", "mixtral-8x7b", "--trace", "synthetic:mixtral-8x7b", "--device", "cuda")
    assert r.exit_code == 2
    assert r.output.strip() == "error: no CUDA GPU is visible here: pass --device cpu to run the same engine on the CPU"


@pytest.mark.parametrize("args, message", [
    (["--spec", "mixtral-8x7b", "--trace", "synthetic:mixtral-8x7b", "--pool-gb", "1"],
     "error: a 1.00 GB pool cannot hold mixtral-8x7b's resident weights (3.21 GB), KV cache (0.04 GB) and workspace: raise --pool-gb"),
    (["--spec", "mixtral-8x7b", "--trace", "synthetic:mixtral-8x7b", "--pool-gb", "4"],
     "error: the expert pool gets 0.48 GB, but every MoE layer needs at least 2 slots (top-k) of its padded size: 5.99 GB; raise --pool-gb"),
    (["--spec", "olmoe-1b-7b", "--trace", "synthetic:mixtral-8x7b"],
     "error: the trace was recorded on mixtral-8x7b (family = mixtral) but the model is olmoe-1b-7b (family = olmoe): trace this model with cmoe trace"),
    (["--spec", "mixtral-8x7b"], "error: random weights route at random: give --trace BUNDLE (or synthetic:PRESET) to replay routing"),
    (["--spec", "mixtral-8x7b", "--trace", "synthetic:mixtral-8x7b", "--quant", "w3g128"],
     "error: the executor runs experts as w4g32/w4g64/w4g128/w4g256, bf16 or fp32, not 'w3g128': pick one with --quant (mixed-bit and GPTQ recipes are simulator-only for now)"),
    (["--spec", "mixtral-8x7b", "--trace", "synthetic:mixtral-8x7b", "--policy", "fast"],
     "error: unknown policy 'fast': choose from upper, ondemand, lru-prefetch, lfu-fallback, static, commit, oracle, adaptive, "
     "adaptive-ahead, commit-ahead"),
])
def test_bad_input_is_one_line_before_any_work(args, message):
    r = _cli("execute", "--device", "cpu", *args)
    assert r.exit_code == 2
    assert r.output.strip() == message


def test_execute_cli_writes_metrics_and_timelines_and_accepts_a_policy_file(checkpoints, tiny_trace, tmp_path):
    from cmoe.core.timeline import read_parquet
    sim = _cli("simulate", "--trace", str(tiny_trace), "--policy", "ondemand", "--pool-gb", "0.2686",
               "--out", str(tmp_path / "sim"))
    assert sim.exit_code == 0, sim.output
    pj = tmp_path / "sim" / "policy-ondemand.json"
    r = _cli("execute", "--model", str(checkpoints["mixtral"]), "--trace", str(tiny_trace), "--policy-json", str(pj),
             "--device", "cpu", "--tokens", "3", "--out", str(tmp_path / "ex"))
    assert r.exit_code == 0, r.output
    import json
    m = json.loads((tmp_path / "ex" / "metrics.json").read_text())
    layout = json.loads(pj.read_text())["layout"]
    assert m[0]["policy"] == "ondemand" and m[0]["decode_tokens"] == 3
    assert m[0]["experts_fit"] == sum(layout["slots"])
    assert len(m[0]["cpu_ref_us"]) == 2 and all(x > 0 for x in m[0]["cpu_ref_us"])   # the CPU's loop around its passes
    spans = read_parquet(tmp_path / "ex" / "timeline-ondemand.parquet")
    assert {s[4] for s in spans} >= {"attention", "route", "expert", "head"}
    assert json.loads((tmp_path / "ex" / "timeline-ondemand.json").read_text())["traceEvents"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    r = _cli("execute", "--model", str(checkpoints["mixtral"]), "--policy-json", str(bad), "--device", "cpu")
    assert r.exit_code == 2 and "is not a cmoe policy file" in r.output


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_look_ahead_policies_replay_their_traces_predictions(checkpoints, tiny_trace, engine):
    """Three slots of four: the look-ahead policies fetch ahead, and the executor's plans (begin
    passes included) are the policy's own, driven by the trace's predictions by distance."""
    from cmoe.trace import bundle
    assert bundle.read(tiny_trace).depth == 4
    cfg = ExecConfig(policies=("adaptive-ahead", "commit-ahead"), slots=3, batch=1, tokens=8, device="cpu",
                     quant="fp32", record_plans=True, engine=engine)
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    for r in execute(w, cfg):
        got = [(p.pass_index, p.layer, p.needed, p.loads, p.gpu, p.cpu, p.skipped) for p in r.log.plans]
        assert got == _pure_replay(tiny_trace, r.policy, r.layout, 1, 8), r.policy
        assert any(ld[4] == "prefetch" for p in r.log.plans for ld in p.loads), r.policy
        assert r.log.slot_mismatches == 0 and r.metrics["skipped"] > 0


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_live_look_ahead_comes_from_the_routers_on_the_state_at_hand(checkpoints, monkeypatch, engine):
    """A live run (no trace): at layer m's plan, `ahead[k]` is layer m+1+k's router applied to the
    hidden state that predicts layer m+1 (layer m's MLP input), computed before that plan, ranked
    as the routes are, and read back with layer m's own routes; the pass's start gets the layers
    0.. from the state before layer 0. In prefill, which the policies run exactly, none is read
    back."""
    from cmoe.executor.routes import Routes
    from cmoe.policy.policies import AdaptiveAhead
    events = []
    early, plan = Routes._early_routers, AdaptiveAhead.plan

    def spy_early(self, q, h):
        out = early(self, q, h)
        want = []
        for j in range(q, min(q + self.policy.depth, self.M)):
            _, w, idx = self.gates[j](h)
            rows = torch.gather(idx, 1, torch.argsort(w, dim=1, descending=True, stable=True)).tolist()
            want.append(list(ranked(rows)[0]))
        events.append(("early", q, want))
        return out

    def spy_plan(self, m, needed, predicted_next, ahead=None):
        events.append(("plan", m, ahead))
        return plan(self, m, needed, predicted_next, ahead)
    ahead = Routes._ahead

    def spy_ahead(self, q, live):                    # layers q >= 1: from layer q-1's own read-back
        if self.cur.decode and 0 < q < self.M:
            events.append(("read back", q, getattr(self, "_rb_ahead", (None, None))[:2] == (self.cur.index, q)))
        return ahead(self, q, live)
    monkeypatch.setattr(Routes, "_early_routers", spy_early)
    monkeypatch.setattr(AdaptiveAhead, "plan", spy_plan)
    monkeypatch.setattr(Routes, "_ahead", spy_ahead)
    _, (r,) = run_exec(checkpoints["mixtral"], ["adaptive-ahead"], batch=1, tokens=4, engine=engine)
    M = len(r.layout.slots)
    plans = [i for i, ev in enumerate(events) if ev[0] == "plan"]
    assert len(plans) == 5 * M and all(events[i][2] is None for i in plans[:M])   # prefill reads none
    checked = 0
    for i in plans[M:]:
        ev = events[i]
        if ev[1] + 1 < M:
            made = [e for e in events[:i] if e[:2] == ("early", ev[1] + 1)]
            assert made and ev[2] == made[-1][2], (i, ev, made[-1:])
            assert len(ev[2]) == min(4, M - 1 - ev[1])
            checked += 1
    assert checked == 4 * (M - 1)
    assert any(len(e[2]) > 1 for e in events if e[0] == "early")
    assert [e[2] for e in events if e[0] == "read back"] == [True] * (4 * (M - 1))
