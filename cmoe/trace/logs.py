"""Routing logs other systems write, read into trace bundles and written back. numpy only.

- **vLLM** (`--enable-return-routed-experts`; SGLang returns the same per request): one int32
  array `[tokens, num_hidden_layers, top_k]` per request, the prompt's tokens first, dense layers
  as rows of zeros, no weights. Read from a `.npy` (one request), a `.npz` (one array per
  request, in key order) or a folder of `.npy` files (in name order). The array does not say
  where the prompt ends: `prompt_tokens` does.
- **Megatron-LM RouterTracer**: JSONL, one record per (step, layer) like `{"step", "stage",
  "block", "layer", "rank", "num_tokens", "topk", "top_indices": [[...]]}`. `layer` is Megatron's
  1-based decoder layer number. The records of one (rank, step, block) are one sequence, taken as
  one request; a causal model routes a token the same whether the sequence was run at once or
  decoded token by token, so its first `prompt_tokens` tokens are replayed as the prompt and the
  rest as decode steps.

Neither log holds router weights nor next-layer predictions: an imported trace has uniform
weights 1/K (its `source` says so) and predictions of -1, and the policies that need
predictions refuse it in one line (`cmoe.trace.passes.check_predictions`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cmoe.core.errors import CmoeError
from cmoe.core.quant import QuantRecipe, expert_bytes
from cmoe.core.spec import ModelSpec
from cmoe.trace.bundle import DECODE, PREFILL, Trace

def log_format(path: Path) -> str:
    """Which kind of log a path holds, by its shape on disk."""
    if path.is_dir() or path.suffix in (".npy", ".npz"):
        return "vllm"
    if path.suffix in (".jsonl", ".json"):
        return "megatron"
    raise CmoeError(f"{path}: not a routing log cmoe reads (.npy, .npz or a folder of .npy from vLLM or "
                    f"SGLang, .jsonl from Megatron's RouterTracer)")


def import_log(path: Path, spec: ModelSpec, rec: QuantRecipe, prompt_tokens: int | None) -> Trace:
    if not path.exists():
        raise CmoeError(f"{path} does not exist: give a routing log file or folder")
    kind = log_format(path)
    if kind == "vllm":
        if prompt_tokens is None:
            raise CmoeError("a vLLM routing log does not say where each prompt ends: pass --prompt-tokens N")
        rows = _vllm_requests(path)
        layers = spec.num_layers
        for i, a in enumerate(rows):
            if a.ndim != 3 or a.shape[1:] != (layers, spec.top_k):
                raise CmoeError(f"{path}: request {i} has shape {a.shape}, but {spec.name} needs "
                                f"[tokens, {layers} layers, top-{spec.top_k}]: is the log from this model?")
        per_req = [a[:, list(spec.moe_layers)] for a in rows]
    else:
        per_req = _megatron_requests(path, spec)
    return _trace(per_req, spec, rec, 1 if prompt_tokens is None else prompt_tokens, {"kind": kind, "path": str(path)})


def _vllm_requests(path: Path) -> list[np.ndarray]:
    try:
        if path.is_dir():
            files = sorted(path.glob("*.npy"))
            if not files:
                raise CmoeError(f"{path} holds no .npy files: give vLLM's per-request routed-experts arrays")
            return [np.load(f, allow_pickle=False) for f in files]
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return [z[k] for k in z.files]
        return [np.load(path, allow_pickle=False)]
    except (ValueError, OSError, EOFError) as e:
        raise CmoeError(f"{path}: not a readable numpy array ({str(e).splitlines()[0]})") from None


def _megatron_requests(path: Path, spec: ModelSpec) -> list[np.ndarray]:
    """Records grouped by (rank, step, block), in order of first appearance: [tokens, M, K] each."""
    moe = {d + 1: m for m, d in enumerate(spec.moe_layers)}               # Megatron's 1-based layer number
    seqs: dict[tuple, dict[int, np.ndarray]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                key, layer = (r.get("rank", 0), r["step"], r.get("block", 0)), int(r["layer"])
                idx = np.asarray(r["top_indices"], dtype=np.int64)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                raise CmoeError(f"{path}:{n}: not a RouterTracer record (step, layer, top_indices)") from None
            if layer not in moe:
                raise CmoeError(f"{path}:{n}: layer {layer} is not one of {spec.name}'s MoE layers "
                                f"(1-based: {min(moe)}..{max(moe)})")
            if idx.ndim != 2 or idx.shape[1] != spec.top_k or ("num_tokens" in r and idx.shape[0] != r["num_tokens"]):
                raise CmoeError(f"{path}:{n}: top_indices has shape {list(idx.shape)}, expected "
                                f"[num_tokens, {spec.top_k}] for {spec.name}")
            seqs.setdefault(key, {})[moe[layer]] = idx
    if not seqs:
        raise CmoeError(f"{path} holds no records")
    out = []
    for key, layers in seqs.items():
        if len(layers) != spec.num_moe_layers or len({a.shape[0] for a in layers.values()}) != 1:
            raise CmoeError(f"{path}: step {key[1]} (rank {key[0]}, block {key[2]}) has {len(layers)} of "
                            f"{spec.num_moe_layers} MoE layers or layers of different lengths")
        out.append(np.stack([layers[m] for m in range(spec.num_moe_layers)], 1))
    return out


def _trace(per_req: list[np.ndarray], spec: ModelSpec, rec: QuantRecipe, prompt_tokens: int, source: dict) -> Trace:
    """Requests of [tokens, M, K] expert ids -> a Trace, request by request."""
    E, K = spec.num_experts, spec.top_k
    for i, a in enumerate(per_req):
        if a.shape[0] <= prompt_tokens:
            raise CmoeError(f"request {i} has {a.shape[0]} tokens, not more than --prompt-tokens {prompt_tokens}: "
                            f"nothing would be decoded")
        if a.min() < 0 or a.max() >= E:
            raise CmoeError(f"request {i} routes to expert {int(a.max() if a.max() >= E else a.min())}, outside "
                            f"0..{E - 1}: is the log from {spec.name}?")
        if np.any(np.sort(a, -1)[..., 1:] == np.sort(a, -1)[..., :-1]):
            raise CmoeError(f"request {i} routes a token to the same expert twice in one layer: "
                            f"dense layers must be left out (give the model's own spec)")
    experts = np.concatenate(per_req).astype(np.int16)
    steps = [np.arange(a.shape[0], dtype=np.int32) for a in per_req]
    step = np.concatenate(steps)
    T = step.size
    return Trace(experts=experts, weights=np.full((T, spec.num_moe_layers, K), 1.0 / K, np.float32),
                 pred_experts=np.full_like(experts, -1),
                 request=np.concatenate([np.full(s.size, i, np.int32) for i, s in enumerate(steps)]),
                 step=step, phase=np.where(step < prompt_tokens, PREFILL, DECODE).astype(np.uint8),
                 spec=spec, recipe=rec, expert_bytes=expert_bytes(spec, rec),
                 source={**source, "prompt_tokens": prompt_tokens, "weights": "absent in the log: uniform 1/top_k",
                         "predictions": "absent in the log: -1"})


def export_vllm(t: Trace, folder: Path) -> list[Path]:
    """One int32 `[tokens, num_hidden_layers, top_k]` .npy per request (dense layers zero rows),
    tokens by position: what vLLM returns. Weights and predictions have no place in it."""
    from cmoe.core.util import atomic_dir
    files = []
    with atomic_dir(folder, force=False) as tmp:
        for r in np.unique(t.request):
            idx = np.nonzero(t.request == r)[0]
            idx = idx[np.argsort(t.step[idx], kind="stable")]
            a = np.zeros((idx.size, t.spec.num_layers, t.spec.top_k), np.int32)
            a[:, list(t.spec.moe_layers)] = t.experts[idx]
            name = f"request-{int(r):06d}.npy"
            np.save(tmp / name, a)
            files.append(folder / name)
    return files
