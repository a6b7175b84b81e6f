"""The non-expert part of the model: transformers' own modules, on the device, with each MoE
block's experts module replaced by a thin shim that hands (hidden states, routing) to the engine.

Why transformers' modules rather than a lean decoder of our own: one code path then serves all six
families (MLA attention, shared experts, dense first layers, QK norms) exactly as their authors
wrote them, and the executor's logits can be checked against the unmodified model. The cost is
measured, not assumed: the benchmark reports the time per token spent outside the experts.

The model is built on the meta device (no weights allocated), the experts modules are swapped
out, and only then is memory taken, so a full-size model never materialises its experts. Weights
come from the checkpoint, streamed tensor by tensor, or are seeded random values for timing
studies at a preset's exact shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cmoe.core.errors import CmoeError
from cmoe.core.spec import ModelSpec


class ExpertsShim(nn.Module):
    """Stands where `mlp.experts` stood: same call signature, the engine does the work."""

    def __init__(self, moe_index: int):
        super().__init__()
        self.moe_index = moe_index
        self.engine = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.engine.moe_layer(self.moe_index, hidden_states, top_k_index, top_k_weights)


def hf_config(spec: ModelSpec):
    """A transformers config with a preset's shapes (for random-weight timing runs)."""
    import transformers as tf
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  num_experts_per_tok=spec.top_k, max_position_embeddings=32768,
                  tie_word_embeddings=spec.tie_embeddings)
    if spec.family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=spec.expert_ffn, num_local_experts=spec.num_experts,
                                head_dim=spec.head_dim)
    if spec.family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=spec.expert_ffn, num_experts=spec.num_experts,
                              norm_topk_prob=spec.renormalize)
    if spec.family in ("qwen2_moe", "qwen3_moe"):
        cls = tf.Qwen2MoeConfig if spec.family == "qwen2_moe" else tf.Qwen3MoeConfig
        extra = dict(shared_expert_intermediate_size=spec.shared_ffn) if spec.family == "qwen2_moe" else dict(head_dim=spec.head_dim)
        return cls(**common, intermediate_size=spec.dense_ffn or spec.expert_ffn, moe_intermediate_size=spec.expert_ffn,
                   num_experts=spec.num_experts, norm_topk_prob=spec.renormalize, **extra)
    if spec.family in ("deepseek_v2", "deepseek_v3"):
        cls = tf.DeepseekV2Config if spec.family == "deepseek_v2" else tf.DeepseekV3Config
        return cls(**common, intermediate_size=spec.dense_ffn, moe_intermediate_size=spec.expert_ffn,
                   n_routed_experts=spec.num_experts, n_shared_experts=spec.shared_ffn // spec.expert_ffn,
                   first_k_dense_replace=spec.moe_layers[0], kv_lora_rank=spec.kv_lora_rank,
                   q_lora_rank=spec.q_lora_rank or None, qk_nope_head_dim=spec.qk_nope_dim,
                   qk_rope_head_dim=spec.qk_rope_dim, v_head_dim=spec.v_head_dim, norm_topk_prob=spec.renormalize,
                   routed_scaling_factor=spec.scaling, n_group=1, topk_group=1)
    raise CmoeError(f"no random-weight config for family {spec.family}")


def _skeleton(config, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, list[ExpertsShim]]:
    from transformers import AutoModelForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shims = []
    for m, d in enumerate(spec.moe_layers):
        mlp = model.model.layers[d].mlp
        if not hasattr(mlp, "experts") or not hasattr(mlp, "gate"):
            raise CmoeError(f"decoder layer {d} of {spec.name} has no experts/gate pair that cmoe knows how to replace")
        mlp.experts = ExpertsShim(m)
        shims.append(mlp.experts)
    model.to_empty(device=device)
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=model.config).to(device)
    return model.eval(), shims


def _rename(name: str, family: str) -> str:
    return name.replace(".block_sparse_moe.", ".mlp.") if family == "mixtral" else name


def load_checkpoint_model(model_dir: Path, spec: ModelSpec, others: list[tuple[str, Path]], device: torch.device,
                          dtype: torch.dtype) -> tuple[nn.Module, list[ExpertsShim]]:
    """Non-expert weights from the checkpoint, tensor by tensor, into the skeleton."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from cmoe.trace.hf import hf_load
    config = hf_load(model_dir, "config.json", AutoConfig.from_pretrained, model_dir)
    model, shims = _skeleton(config, spec, device, dtype)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    by_file: dict[Path, list[str]] = {}
    for name, path in others:
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as fh:
                for name in names:
                    target = _rename(name, spec.family)
                    if target not in params:
                        continue                      # e.g. rotary caches some checkpoints carry
                    t = fh.get_tensor(name)
                    if t.shape != params[target].shape:
                        raise CmoeError(f"{name} has shape {tuple(t.shape)} in the checkpoint but the model "
                                        f"expects {tuple(params[target].shape)}")
                    params[target].copy_(t.to(params[target].dtype))
                    loaded.add(target)
    if config.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    persistent = set(model.state_dict())
    missing = sorted(n for n in persistent if n not in loaded and "rotary_emb" not in n)
    if missing:
        raise CmoeError(f"{model_dir} lacks {len(missing)} non-expert tensors the model needs (first: {missing[0]})")
    return model, shims


def random_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[nn.Module, list[ExpertsShim]]:
    """Seeded random non-expert weights at a preset's shapes (norms at one, linears N(0, 0.02))."""
    model, shims = _skeleton(hf_config(spec), spec, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(p.dtype) * 0.02)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.zero_()
    return model, shims
