"""The tracer on self-made checkpoints of every family: what it records is what the model used."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cmoe.core.spec import from_checkpoint  # noqa: E402
from cmoe.trace.bundle import DECODE, PREFILL  # noqa: E402
from cmoe.trace.hf import TraceOptions, trace_checkpoint  # noqa: E402
from tests.conftest import FAMILIES  # noqa: E402


def _spy_on_experts(model, spec):
    """Record what each MoE block's experts module actually received: (indices, weights)."""
    seen = {m: [] for m in range(spec.num_moe_layers)}
    hooks = []
    for m, d in enumerate(spec.moe_layers):
        def pre(_mod, args, m=m):
            _, idx, w = args
            order = torch.argsort(w.float(), dim=-1, descending=True, stable=True)
            seen[m].append((idx.gather(-1, order).cpu().numpy(), w.float().gather(-1, order).cpu().numpy()))
        hooks.append(model.model.layers[d].mlp.experts.register_forward_pre_hook(pre))
    return seen, hooks


def _trace_and_spy(path, prompts, monkeypatch, opts):
    """Trace a checkpoint while spying on what its experts modules receive."""
    import cmoe.trace.hf as hf
    spied = {}
    real_load = hf.load_model

    def load_and_spy(*a, **k):
        model, s = real_load(*a, **k)
        spied["seen"], _ = _spy_on_experts(model, s)
        return model, s
    monkeypatch.setattr(hf, "load_model", load_and_spy)
    return trace_checkpoint(path, prompts, opts), spied["seen"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trace_matches_the_models_own_routing(family, checkpoints, prompts, monkeypatch):
    spec = from_checkpoint(checkpoints[family])
    t, seen = _trace_and_spy(checkpoints[family], prompts, monkeypatch,
                             TraceOptions(max_new_tokens=4, progress=False, device="cpu", record_logits=True))
    n_tokens = [len(s.encode()) for s in prompts.read_text().splitlines()]
    assert t.num_tokens == sum(n + 4 for n in n_tokens)
    assert t.experts.shape == (t.num_tokens, spec.num_moe_layers, spec.top_k)
    for m in range(spec.num_moe_layers):
        idx = np.concatenate([a for a, _ in seen[m]])
        w = np.concatenate([b for _, b in seen[m]])
        assert np.array_equal(t.experts[:, m], idx)
        np.testing.assert_allclose(t.weights[:, m], w, rtol=1e-6)
    # request/step/phase layout: prefill of the prompt, then 4 decode steps, for each request
    r0 = t.request == 0
    assert t.step[r0].tolist() == list(range(n_tokens[0] + 4))
    assert t.phase[r0].tolist() == [PREFILL] * n_tokens[0] + [DECODE] * 4
    assert t.router_logits.shape == (t.num_tokens, spec.num_moe_layers, spec.num_experts)
    assert t.source["kind"] == "hf" and t.source["family"] == family


def test_commit_prediction_is_next_router_on_previous_mlp_input(checkpoints, prompts):
    """Mixtral: pred for layer m = top-k of softmax(gate_m @ post_attention_layernorm_{m-1} output)."""
    from transformers import AutoModelForCausalLM
    path = checkpoints["mixtral"]
    t = trace_checkpoint(path, prompts, TraceOptions(max_new_tokens=0, progress=False, device="cpu"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    captured = {}
    for d, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_hook(lambda _m, _i, o, d=d: captured.__setitem__(d, o[0]))
        if d == 0:
            layer.input_layernorm.register_forward_hook(lambda _m, _i, o: captured.__setitem__("in0", o[0]))
    ids = [b % 64 for b in prompts.read_text().splitlines()[0].encode()]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    n = len(ids)
    for m in range(3):
        h = captured["in0"] if m == 0 else captured[m - 1]
        probs = torch.softmax(h @ model.model.layers[m].mlp.gate.weight.T, -1)
        want = torch.topk(probs, 2, -1).indices.numpy()
        assert np.array_equal(np.sort(t.pred_experts[:n, m], -1), np.sort(want, -1))
    # distance k: layer m's router on the state of layer m-k (the input norm of layer 0 for m-k = -1)
    assert t.depth == min(4, t.spec.num_moe_layers) > 1 and np.array_equal(t.pred_ahead[:, :, 0], t.pred_experts)
    for k in range(2, t.depth + 1):
        assert (t.pred_ahead[:, : k - 1, k - 1] == -1).all()
        for m in range(k - 1, t.spec.num_moe_layers):
            h = captured["in0"] if m - k == -1 else captured[m - k]
            want = torch.topk(torch.softmax(h @ model.model.layers[m].mlp.gate.weight.T, -1), 2, -1).indices.numpy()
            assert np.array_equal(np.sort(t.pred_ahead[:n, m, k - 1], -1), np.sort(want, -1)), (k, m)
    # the prediction for layer 0 is its own router before attention; for later layers it differs
    # from the true route somewhere (different hidden state)
    assert not np.array_equal(t.pred_experts[:, 1:], t.experts[:, 1:])


def test_checkpoint_sizes_mode(checkpoints, prompts):
    t = trace_checkpoint(checkpoints["qwen2_moe"], prompts,
                         TraceOptions(max_new_tokens=1, progress=False, device="cpu", quant="checkpoint"))
    assert t.recipe.expert == "fp32" and t.expert_bytes[0][0] == 3 * 16 * 32 * 4


def test_a_weight_missing_from_the_checkpoint_is_refused_not_left_random(checkpoints, prompts, tmp_path):
    """transformers would initialise the missing tensor at random and trace "successfully"."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from cmoe.core.errors import CmoeError
    d = tmp_path / "holed"
    shutil.copytree(checkpoints["qwen3_moe"], d)
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(CmoeError) as e:
        trace_checkpoint(d, prompts, TraceOptions(max_new_tokens=1, progress=False, device="cpu"))
    assert str(e.value) == (f"could not load the checkpoint in {d}: transformers found 1 of the model's weights nowhere "
                            f"in it (first: model.layers.1.self_attn.q_proj.weight), so they would keep random values; "
                            f"the checkpoint lacks them or config.json is not its own: re-download the checkpoint")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_trace_on_cuda_matches_the_models_routing(family, checkpoints, prompts, monkeypatch):
    """Same check as the CPU test, on the GPU (bf16 weights there)."""
    spec = from_checkpoint(checkpoints[family])
    t, seen = _trace_and_spy(checkpoints[family], prompts, monkeypatch,
                             TraceOptions(max_new_tokens=4, progress=False, device="cuda"))
    assert t.source["device"] == "cuda"
    for m in range(spec.num_moe_layers):
        assert np.array_equal(t.experts[:, m], np.concatenate([a for a, _ in seen[m]]))
