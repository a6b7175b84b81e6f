"""ModelSpec: the shape of an MoE architecture, from a checkpoint's config.json or a preset.

Floor 1 of cmoe: plain data, imports nothing of cmoe but the error type. Every other module asks
this one how many MoE layers there are, which decoder layers they sit in, and how large the
non-expert weights are.

Presets carry the published config.json values of each model (Hugging Face model cards,
2023-2024): Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1, DeepSeek-V2-Lite, Qwen1.5-MoE-A2.7B,
OLMoE-1B-7B-0924.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cmoe.core.errors import CmoeError

FAMILIES = ("mixtral", "deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str                      # config.json model_type, one of FAMILIES
    num_layers: int                  # decoder layers, dense and MoE
    hidden: int
    expert_ffn: int                  # intermediate size of one routed expert
    num_experts: int                 # routed experts per MoE layer
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    moe_layers: tuple[int, ...]      # decoder-layer indices that hold an MoE block
    dense_ffn: int = 0               # intermediate size of the dense MLP of non-MoE layers
    shared_ffn: int = 0              # total intermediate size of the shared expert(s), 0 if none
    renormalize: bool = True         # top-k weights renormalised to sum to 1
    scoring: str = "softmax"         # router score function: softmax or sigmoid
    scaling: float = 1.0             # routed_scaling_factor (DeepSeek)
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # multi-head latent attention (DeepSeek); 0 means plain grouped-query attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise CmoeError(f"unsupported architecture '{self.family}': cmoe supports {', '.join(FAMILIES)}")
        for k in ("num_layers", "hidden", "expert_ffn", "num_experts", "top_k", "num_heads", "vocab"):
            if getattr(self, k) <= 0:
                raise CmoeError(f"model spec {self.name}: {k} must be positive, got {getattr(self, k)}")
        if self.top_k > self.num_experts:
            raise CmoeError(f"model spec {self.name}: top_k {self.top_k} exceeds {self.num_experts} experts")
        if not self.moe_layers or any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise CmoeError(f"model spec {self.name}: MoE layer indices must lie in 0..{self.num_layers - 1}")

    # derived values -----------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.moe_layers))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_shapes(self) -> dict[str, tuple[int, int]]:
        """Linear layers of one attention block as name -> (out, in)."""
        h = self.hidden
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            s = {"kv_a_proj_with_mqa": (self.kv_lora_rank + self.qk_rope_dim, h),
                 "kv_b_proj": (self.num_heads * (self.qk_nope_dim + self.v_head_dim), self.kv_lora_rank),
                 "o_proj": (h, self.num_heads * self.v_head_dim)}
            if self.q_lora_rank:
                s["q_a_proj"] = (self.q_lora_rank, h)
                s["q_b_proj"] = (self.num_heads * qk, self.q_lora_rank)
            else:
                s["q_proj"] = (self.num_heads * qk, h)
            return s
        return {"q_proj": (self.num_heads * self.head_dim, h),
                "k_proj": (self.num_kv_heads * self.head_dim, h),
                "v_proj": (self.num_kv_heads * self.head_dim, h),
                "o_proj": (h, self.num_heads * self.head_dim)}

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """One routed expert as name -> (out, in), in Mixtral's names: w1 gate, w3 up, w2 down."""
        f, h = self.expert_ffn, self.hidden
        return {"w1": (f, h), "w3": (f, h), "w2": (h, f)}

    def mlp_shapes(self, ffn: int) -> dict[str, tuple[int, int]]:
        return {"w1": (ffn, self.hidden), "w3": (ffn, self.hidden), "w2": (self.hidden, ffn)}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["moe_layers"] = tuple(d["moe_layers"])
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise CmoeError(f"model spec has unknown fields {sorted(unknown)}: was it written by a newer cmoe?")
        return cls(**d)


def _moe_layers_qwen(cfg: dict, n: int) -> tuple[int, ...]:
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    return tuple(i for i in range(n) if i not in only and (i + 1) % step == 0)


def from_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json dictionary."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise CmoeError(f"unsupported architecture '{family}' in config.json: cmoe supports {', '.join(FAMILIES)}")
    n = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    base = dict(name=name or cfg.get("_name_or_path") or family, family=family, num_layers=n,
                hidden=cfg["hidden_size"], num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                top_k=cfg["num_experts_per_tok"])
    if family == "mixtral":
        return ModelSpec(**base, expert_ffn=cfg["intermediate_size"], num_experts=cfg["num_local_experts"],
                         moe_layers=tuple(range(n)), renormalize=True)
    if family in ("qwen2_moe", "qwen3_moe"):
        e = cfg.get("num_experts") or cfg.get("num_local_experts")
        shared = cfg.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return ModelSpec(**base, expert_ffn=cfg["moe_intermediate_size"], num_experts=e,
                         moe_layers=_moe_layers_qwen(cfg, n), dense_ffn=cfg.get("intermediate_size", 0),
                         shared_ffn=shared, renormalize=bool(cfg.get("norm_topk_prob", False)),
                         qkv_bias=family == "qwen2_moe")
    if family == "olmoe":
        return ModelSpec(**base, expert_ffn=cfg["intermediate_size"], num_experts=cfg["num_experts"],
                         moe_layers=tuple(range(n)), renormalize=bool(cfg.get("norm_topk_prob", False)))
    # deepseek_v2 / deepseek_v3
    k_dense = cfg.get("first_k_dense_replace", 0) or 0
    mla = dict(kv_lora_rank=cfg.get("kv_lora_rank") or 0, q_lora_rank=cfg.get("q_lora_rank") or 0,
               qk_nope_dim=cfg.get("qk_nope_head_dim") or 0, qk_rope_dim=cfg.get("qk_rope_head_dim") or 0,
               v_head_dim=cfg.get("v_head_dim") or 0)
    return ModelSpec(**base, expert_ffn=cfg["moe_intermediate_size"], num_experts=cfg["n_routed_experts"],
                     moe_layers=tuple(range(k_dense, n)), dense_ffn=cfg["intermediate_size"],
                     shared_ffn=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                     renormalize=bool(cfg.get("norm_topk_prob", False)),
                     scoring="sigmoid" if family == "deepseek_v3" else "softmax",
                     scaling=float(cfg.get("routed_scaling_factor", 1.0) or 1.0), **mla)


def from_checkpoint(path: str | Path) -> ModelSpec:
    p = Path(path)
    if not p.is_dir():
        raise CmoeError(f"model directory {p} does not exist: pass --model a local Hugging Face checkpoint folder")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise CmoeError(f"{p} has no config.json: is it a Hugging Face checkpoint folder?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CmoeError(f"{cfg_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise CmoeError(f"{cfg_path} holds a JSON {type(cfg).__name__}, not an object: restore the checkpoint's own config.json")
    try:
        return from_config(cfg, name=p.name)
    except KeyError as e:
        raise CmoeError(f"{cfg_path} lacks '{e.args[0]}', which a {cfg.get('model_type')} config needs: "
                        f"restore the checkpoint's own config.json") from None
    except TypeError as e:
        raise CmoeError(f"{cfg_path} holds a value of the wrong type ({e}): restore the checkpoint's own config.json") from None


PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b", family="mixtral", num_layers=32, hidden=4096, expert_ffn=14336,
        num_experts=8, top_k=2, num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000,
        moe_layers=tuple(range(32))),
    "mixtral-8x22b": ModelSpec(
        name="mixtral-8x22b", family="mixtral", num_layers=56, hidden=6144, expert_ffn=16384,
        num_experts=8, top_k=2, num_heads=48, num_kv_heads=8, head_dim=128, vocab=32000,
        moe_layers=tuple(range(56))),
    "deepseek-v2-lite": ModelSpec(
        name="deepseek-v2-lite", family="deepseek_v2", num_layers=27, hidden=2048, expert_ffn=1408,
        num_experts=64, top_k=6, num_heads=16, num_kv_heads=16, head_dim=128, vocab=102400,
        moe_layers=tuple(range(1, 27)), dense_ffn=10944, shared_ffn=2 * 1408, renormalize=False,
        kv_lora_rank=512, q_lora_rank=0, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128),
    "qwen1.5-moe-a2.7b": ModelSpec(
        name="qwen1.5-moe-a2.7b", family="qwen2_moe", num_layers=24, hidden=2048, expert_ffn=1408,
        num_experts=60, top_k=4, num_heads=16, num_kv_heads=16, head_dim=128, vocab=151936,
        moe_layers=tuple(range(24)), dense_ffn=5632, shared_ffn=5632, renormalize=False, qkv_bias=True),
    "olmoe-1b-7b": ModelSpec(
        name="olmoe-1b-7b", family="olmoe", num_layers=16, hidden=2048, expert_ffn=1024,
        num_experts=64, top_k=8, num_heads=16, num_kv_heads=16, head_dim=128, vocab=50304,
        moe_layers=tuple(range(16)), renormalize=False),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise CmoeError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}") from None
