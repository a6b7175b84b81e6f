"""Statistics of a trace, real or synthetic: per-layer load and entropy, repetition between
consecutive tokens (the Mixtral paper's Table 5 measures), reuse distance, commit-prediction
accuracy and bytes per token. numpy only.

Dimension letters: T tokens, M MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb, log

import numpy as np

from cmoe.trace.bundle import DECODE, Trace


@dataclass(frozen=True)
class LayerStats:
    layer: int                # decoder-layer index
    max_load: float           # busiest expert's share x E (1.0 = perfectly even)
    entropy: float            # entropy of the load over log(E) (1.0 = perfectly even)
    rep_first: float          # consecutive tokens keep the same first expert
    rep_any: float            # consecutive tokens share at least one expert
    reuse_mean: float         # mean tokens between two uses of one expert
    pred_acc: float           # share of true experts that the commit prediction held; nan if none
    bytes_per_token: float    # mean bytes of the experts one decode token reads in this layer


def one_hot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, M, K] ids -> [T, M, E] bool."""
    T, M, K = experts.shape
    oh = np.zeros((T, M, num_experts), dtype=bool)
    oh[np.arange(T)[:, None, None], np.arange(M)[None, :, None], experts.astype(np.int64)] = True
    return oh


def consecutive_pairs(t: Trace) -> np.ndarray:
    """Indices i such that tokens i-1 and i are consecutive steps of one request."""
    same = (t.request[1:] == t.request[:-1]) & (t.step[1:] == t.step[:-1] + 1)
    return np.nonzero(same)[0] + 1


def random_rep_any(num_experts: int, top_k: int) -> float:
    """Chance that two independent uniform top-k sets share an expert (Mixtral's 'random')."""
    return 1 - comb(num_experts - top_k, top_k) / comb(num_experts, top_k)


def prediction_accuracy(experts: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """Per layer, the share of true experts found in the predicted set; nan where none predicted."""
    T, M, K = experts.shape
    hit = (experts[..., :, None] == pred[..., None, :]).any(-1)     # [T, M, K]
    valid = (pred >= 0).all(-1)                                     # [T, M]
    num = (hit.sum(-1) * valid).sum(0).astype(float)
    den = valid.sum(0) * K
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def reuse_distance(oh: np.ndarray) -> np.ndarray:
    """Per layer, mean number of tokens between consecutive uses of the same expert."""
    T, M, E = oh.shape
    out = np.full(M, np.nan)
    for m in range(M):
        gaps = [np.diff(np.nonzero(oh[:, m, e])[0]) for e in range(E)]
        gaps = np.concatenate(gaps) if gaps else np.array([])
        if gaps.size:
            out[m] = gaps.mean()
    return out


def load_share(oh: np.ndarray) -> np.ndarray:
    """[M, E]: each expert's share of its layer's choices, from the one-hot routes [T, M, E]."""
    load = oh.sum(0).astype(float)
    return load / np.maximum(load.sum(1, keepdims=True), 1)


def layer_stats(t: Trace) -> list[LayerStats]:
    s = t.spec
    E = s.num_experts
    oh = one_hot(t.experts, E)
    share = load_share(oh)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(share > 0, share * np.log(share), 0.0), 1) / log(E)
    pairs = consecutive_pairs(t)
    if pairs.size:
        rep_first = (t.experts[pairs, :, 0] == t.experts[pairs - 1, :, 0]).mean(0)
        rep_any = (oh[pairs] & oh[pairs - 1]).any(-1).mean(0)
    else:
        rep_first = rep_any = np.full(s.num_moe_layers, np.nan)
    acc = prediction_accuracy(t.experts, t.pred_experts)
    reuse = reuse_distance(oh)
    eb = np.asarray(t.expert_bytes, dtype=float)                    # [M, E]
    dec = t.phase == DECODE
    sel = t.experts[dec] if dec.any() else t.experts
    bpt = eb[np.arange(s.num_moe_layers)[None, :, None], sel.astype(np.int64)].sum(-1).mean(0)
    return [LayerStats(layer=s.moe_layers[m], max_load=float(share[m].max() * E), entropy=float(ent[m]),
                       rep_first=float(rep_first[m]), rep_any=float(rep_any[m]), reuse_mean=float(reuse[m]),
                       pred_acc=float(acc[m]), bytes_per_token=float(bpt[m]))
            for m in range(s.num_moe_layers)]


def summary(t: Trace, layers: list[LayerStats] | None = None) -> dict:
    layers = layers or layer_stats(t)
    s = t.spec
    def mean(k: str) -> float:                       # nan where no layer has the figure (no predictions)
        xs = np.array([getattr(x, k) for x in layers], dtype=float)
        return float(np.nanmean(xs)) if np.isfinite(xs).any() else float("nan")
    return {"model": s.name, "tokens": t.num_tokens, "requests": int(len(np.unique(t.request))),
            "decode_tokens": int((t.phase == DECODE).sum()), "max_load": mean("max_load"),
            "entropy": mean("entropy"), "rep_first": mean("rep_first"), "rep_any": mean("rep_any"),
            "random_rep_first": 1 / s.num_experts, "random_rep_any": random_rep_any(s.num_experts, s.top_k),
            "reuse_mean": mean("reuse_mean"), "pred_acc": mean("pred_acc"),
            "expert_bytes_per_token": float(sum(x.bytes_per_token for x in layers))}


def format_table(t: Trace, layers: list[LayerStats] | None = None) -> str:
    """The `cmoe stats` table as plain text (`layers`: `layer_stats(t)`, if made already)."""
    layers = layers or layer_stats(t)
    sm = summary(t, layers)
    head = f"{'layer':>5} {'max_load':>8} {'entropy':>7} {'rep_1st':>7} {'rep_any':>7} {'reuse':>6} {'pred_acc':>8} {'MB/token':>9}"
    rows = [f"{x.layer:>5} {x.max_load:>8.3f} {x.entropy:>7.3f} {x.rep_first:>7.3f} {x.rep_any:>7.3f} "
            f"{x.reuse_mean:>6.2f} {x.pred_acc:>8.3f} {x.bytes_per_token / 1e6:>9.2f}" for x in layers]
    foot = (f"{'mean':>5} {sm['max_load']:>8.3f} {sm['entropy']:>7.3f} {sm['rep_first']:>7.3f} "
            f"{sm['rep_any']:>7.3f} {sm['reuse_mean']:>6.2f} {sm['pred_acc']:>8.3f} "
            f"{sm['expert_bytes_per_token'] / 1e6:>9.2f} (sum)")
    title = (f"{sm['model']}: {sm['tokens']} tokens ({sm['decode_tokens']} decode) in {sm['requests']} requests; "
             f"random baseline rep_1st {sm['random_rep_first']:.3f}, rep_any {sm['random_rep_any']:.3f}")
    legend = ("max_load: busiest expert's share x E; entropy: of the load, over log E; rep_1st/rep_any: "
              "consecutive tokens keep the first expert / share any expert;\nreuse: mean tokens between "
              "uses of an expert; pred_acc: share of true experts in the commit prediction; MB/token: "
              "expert bytes one decode token reads")
    if not np.isfinite(sm["pred_acc"]):
        legend += "\nthis trace holds no next-layer predictions (an imported log): pred_acc is nan"
    return "\n".join([title, head, *rows, foot, legend])
