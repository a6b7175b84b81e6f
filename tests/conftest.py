"""Shared fixtures: tiny random checkpoints of every supported family, saved with safetensors and
loaded back by path, as a user's checkpoint would be."""

from __future__ import annotations

import importlib.util

import pytest

NO_SIMPY = ("the tests need simpy (the simulator; the executor's replay imports it too): run bash scripts/setup, "
            "or on the GPU machine run them through benchmarks/gpu_session.sh tests, which puts .whl's on the path")


def pytest_configure(config):
    """One line, not dozens of failed tests, where simpy is missing (the thirty-seventh session lost
    30 GPU tests to a shell without it on its path)."""
    if importlib.util.find_spec("simpy") is None:
        pytest.exit(NO_SIMPY, returncode=4)


SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
MLA = dict(SMALL, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def tiny_config(family: str):
    import transformers as tf
    if family == "mixtral":
        return tf.MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(**MLA, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                   n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
                                   q_lora_rank=None, n_group=1, topk_group=1)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**MLA, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                   n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                   q_lora_rank=24, n_group=2, topk_group=1)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                 num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)
    if family == "olmoe":
        return tf.OlmoeConfig(**SMALL, intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                              eos_token_id=None, pad_token_id=None, bos_token_id=None)
    raise ValueError(family)


FAMILIES = ("mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe")


def make_checkpoint(family: str, path, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    if family == "deepseek_v3":   # give the bias correction some effect
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def fused_config(family: str):
    """Tiny shapes the one-launch int4 layer kernel takes (in-features in runs of 32)."""
    cfg = tiny_config(family)
    cfg.hidden_size = 64
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name, None):
            setattr(cfg, name, 64 if name != "moe_intermediate_size" else 32)
    if family == "olmoe":
        cfg.intermediate_size = 32
    if family == "mixtral":
        cfg.intermediate_size = 64
    return cfg


@pytest.fixture(scope="session")
def fused_checkpoints(tmp_path_factory):
    """family -> a tiny checkpoint with shapes the tiled int4 kernel takes (H = 64, F = 32 or 64)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for f in FAMILIES:
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(fused_config(f))
        model.save_pretrained(root / f)
        out[f] = root / f
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> path of a tiny saved checkpoint (built once per test session)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("def fibonacci(n):\nThe mixture of experts routes each token\n")
    return p


@pytest.fixture(scope="session")
def int4_checkpoint(tmp_path_factory):
    """A Mixtral-style checkpoint with shapes the int4 kernels accept (H = F = 64, group 32)."""
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM
    torch.manual_seed(5)
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256)
    path = tmp_path_factory.mktemp("int4") / "mixtral64"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_trace(tmp_path_factory, checkpoints):
    """A synthetic trace with the tiny Mixtral's shapes (fp32 experts), for replay tests."""
    from cmoe.core.quant import QuantRecipe
    from cmoe.core.spec import from_checkpoint
    from cmoe.trace import bundle
    from cmoe.trace.synthetic import SyntheticParams, generate
    spec = from_checkpoint(checkpoints["mixtral"])
    t = generate(spec, QuantRecipe("t", expert="fp32", attention="bf16"),
                 SyntheticParams(requests=2, prompt_len=6, decode_len=10, pred_acc=0.6, seed=1))
    return bundle.write(t, tmp_path_factory.mktemp("tr") / "tiny")
