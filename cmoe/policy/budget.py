"""How much of a GPU memory budget the expert pool gets: the pool size minus the resident
non-expert weights, the KV cache for the batch and a fixed workspace. Pure arithmetic."""

from __future__ import annotations

from cmoe.core.errors import CmoeError
from cmoe.core.quant import QuantRecipe, non_expert_bytes
from cmoe.core.spec import ModelSpec

WORKSPACE_BYTES = 256 * 2**20      # activations, routing buffers, kernel workspace


def kv_bytes(spec: ModelSpec, batch: int, max_len: int) -> int:
    per_layer = (spec.kv_lora_rank + spec.qk_rope_dim) * 2 if spec.is_mla else 2 * spec.num_kv_heads * spec.head_dim * 2
    return batch * max_len * per_layer * spec.num_layers


def expert_budget(spec: ModelSpec, rec: QuantRecipe, pool_bytes: int, batch: int, max_len: int) -> dict:
    if pool_bytes <= 0:
        raise CmoeError(f"the pool size must be positive, got {pool_bytes / 1e9:g} GB")
    resident = sum(non_expert_bytes(spec, rec).values())
    kv = kv_bytes(spec, batch, max_len)
    experts = pool_bytes - resident - kv - WORKSPACE_BYTES
    if experts <= 0:
        raise CmoeError(f"a {pool_bytes / 1e9:.2f} GB pool cannot hold {spec.name}'s resident weights "
                        f"({resident / 1e9:.2f} GB), KV cache ({kv / 1e9:.2f} GB) and workspace: raise --pool-gb")
    return {"pool_bytes": pool_bytes, "resident_bytes": resident, "kv_bytes": kv,
            "workspace_bytes": WORKSPACE_BYTES, "expert_bytes": experts}
