"""`cmoe quality`: teacher-force a held-out text through the executor under exact routing and
under each commit variant, token by token (each a decode pass, so commit applies at every
position), with every expert resident so that only the routing rule differs; then compare the
next-token distributions (`cmoe.quality.measures`). The commit prediction accuracy per layer comes from
the tracer's hooks over the same text.

Variants: `commit` (the committed experts re-weighted by OWA from the true router scores),
`commit-no-owa` (the committed experts with the early prediction's own weights), and `adaptive`
(each layer's top-ranked expert, and the others only if resident), which runs with half of each
layer's experts in the pool, since what it skips depends on what is resident.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from cmoe.core.errors import CmoeError
from cmoe.quality.measures import compare

# variant -> (policy, OWA, pool): "all" holds every expert (only the routing rule differs); "half"
# holds half of each layer's experts (the main job's pool), where adaptive's skips depend on residency
VARIANTS = {"exact": ("upper", True, "all"), "commit": ("commit", True, "all"), "commit-no-owa": ("commit", False, "all"),
            "adaptive": ("adaptive", True, "half"), "adaptive-ahead": ("adaptive-ahead", True, "half"),
            "commit-ahead": ("commit-ahead", True, "half")}
PUBLISHED = ("published next-layer prediction accuracy: about 80% from the previous layer's gate (FATE-style), "
             "93-97% from trained pre-attention predictors (DESIGN.md)")


def run_quality(model_dir: Path, text: bytes | list[int], tokens: int, variants: list[str], device: str = "cpu",
                window: int = 256) -> dict:
    """Score `tokens` positions of `text`, in windows of `window` tokens (each from an empty KV
    cache, so no position exceeds what a small model was trained on)."""
    from cmoe.executor.run import ExecConfig, build, prepare, run_policy
    bad = [v for v in variants if v not in VARIANTS or v == "exact"]
    if bad:
        raise CmoeError(f"unknown variant '{bad[0]}': choose from {', '.join(v for v in VARIANTS if v != 'exact')}")
    if isinstance(text, bytes):                       # through the model's own tokenizer (or bytes)
        from cmoe.core.checkpoint import check_checkpoint
        from cmoe.trace.hf import tokenizer_for
        text = tokenizer_for(Path(model_dir), check_checkpoint(model_dir).vocab)(text.decode("utf-8", errors="replace"))
    ids = list(text)[: tokens + tokens // max(window - 1, 1) + 1]
    if len(ids) < 2:
        raise CmoeError("the held-out text is too short: give at least two tokens")
    if window < 2:
        raise CmoeError("--window must be at least 2 tokens")
    chunks = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    chunks = [c for c in chunks if len(c) >= 2]
    base = ExecConfig(policies=("upper",), batch=1, tokens=window, device=device,
                      quant="fp32" if device == "cpu" else "bf16", keep_logits=True)
    w, base = prepare(spec_name=None, model_dir=model_dir, trace_src=None, data=None, cfg=base)
    base = replace(base, slots=w.spec.num_experts)
    build(w, base)
    logits: dict[str, list] = {v: [] for v in ["exact", *variants]}
    skipped = {v: 0 for v in logits}
    targets = []
    for c in chunks:
        w.prompts = [c[:1]]
        targets += c[1:]
        for v in logits:
            pol, owa, pool = VARIANTS[v]
            slots = w.spec.num_experts if pool == "all" else max(w.spec.num_experts // 2, w.spec.top_k)
            r = run_policy(w, replace(base, owa=owa, slots=slots, tokens=len(c) - 1, teacher=tuple(c[1:])), pol)
            logits[v] += [lg[0].numpy() for lg in r.logits[:-1]]          # pass i predicts token i+1
            skipped[v] += r.log.skipped
    ref = np.stack(logits["exact"])
    rows = [{"variant": v, **compare(ref, np.stack(logits[v]), np.array(targets)), "skipped": skipped[v]}
            for v in logits]
    return {"model": str(model_dir), "tokens": len(targets), "window": window, "rows": rows,
            "pred_accuracy": prediction_accuracy(model_dir, ids[:window], device)}


def prediction_accuracy(model_dir: Path, ids: list[int], device: str) -> dict:
    """Per MoE layer, the share of each token's true experts that the commit prediction held,
    over the text in one teacher-forced forward pass (the tracer's hooks); and the same by the
    predicting router's certainty (its top-k softmax mass), in quartiles over all layers: the
    CommitMoE paper's observation is that certainty and accuracy go together."""
    from cmoe.trace.hf import RouteRecorder, load_model, pick_device
    from cmoe.trace.stats import prediction_accuracy as acc
    model, spec = load_model(Path(model_dir), pick_device(device))
    rec = RouteRecorder(model, spec, False, record_certainty=True)
    try:
        rec.reset()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], device=model.device))
        got = rec.collect()
    finally:
        rec.close()
    per_layer = [float(a) for a in acc(got["experts"], got["pred_experts"])]
    by_distance = accuracy_by_distance(model, spec, ids)
    e, p, c = got["experts"].astype(np.int64), got["pred_experts"].astype(np.int64), got["certainty"]
    hit = (e[..., :, None] == p[..., None, :]).any(-1).mean(-1)             # [T, M] share of true experts predicted
    edges = np.quantile(c, [0, 0.25, 0.5, 0.75, 1.0])
    by_cert = []
    for q in range(4):
        sel = (c >= edges[q]) & ((c <= edges[q + 1]) if q == 3 else (c < edges[q + 1]))
        by_cert.append({"certainty_from": float(edges[q]), "certainty_to": float(edges[q + 1]),
                        "accuracy": float(hit[sel].mean()) if sel.any() else float("nan"), "n": int(sel.sum())})
    return {"per_layer": per_layer, "by_certainty": by_cert, "by_distance": by_distance}


def accuracy_by_distance(model, spec, ids: list[int]) -> list[dict]:
    """How far ahead a router can see: for each distance k, MoE layer m+k's router applied to MoE
    layer m's MLP input (its post-attention norm's output, the commit prediction's source), the
    share of layer m+k's true top-k experts its own top-k holds, over every token and every m
    with m+k in the model (one teacher-forced pass; k = 1 is the commit prediction of every
    layer but the first). What a commit that loads d layers ahead could rely on."""
    layers, moe = model.model.layers, spec.moe_layers
    M = len(moe)
    xs: list = [None] * M
    routes: list = [None] * M
    hooks = []
    for m, d in enumerate(moe):
        hooks.append(layers[d].post_attention_layernorm.register_forward_hook(
            lambda _mod, _inp, out, m=m: xs.__setitem__(m, out.reshape(-1, out.shape[-1]))))
        hooks.append(layers[d].mlp.gate.register_forward_hook(
            lambda _mod, _inp, out, m=m: routes.__setitem__(m, out[2]) if routes[m] is None else None))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], device=model.device))
            out = []
            for k in range(1, M):
                hit = n = 0
                for m in range(M - k):
                    pred = layers[moe[m + k]].mlp.gate(xs[m])[2]                # [T, K]
                    true = routes[m + k]
                    hit += int((true[:, :, None] == pred[:, None, :]).any(-1).sum())
                    n += true.numel()
                out.append({"distance": k, "accuracy": hit / n if n else float("nan"), "pairs": M - k})
    finally:
        for h in hooks:
            h.remove()
    return out
