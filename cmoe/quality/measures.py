"""What committing costs in output quality: next-token distributions of a variant against exact
routing over the same text. Pure numpy (floor 2); `cmoe.quality.run` produces the
logits by teacher forcing the executor.

- KL divergence KL(p_exact || p_variant) per position, in nats, averaged;
- top-1 agreement: share of positions where both pick the same next token;
- perplexity of the text itself under each (exp of the mean next-token negative log-likelihood).
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, p from `ref_logits`, q from `logits` ([N, V] each)."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def agreement(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    return float((ref_logits.argmax(-1) == logits.argmax(-1)).mean())


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of `targets` [N] under `logits` [N, V]."""
    lp = log_softmax(logits)
    return float(np.exp(-lp[np.arange(len(targets)), targets].mean()))


def compare(ref: np.ndarray, var: np.ndarray, targets: np.ndarray) -> dict:
    kl = kl_divergence(ref, var)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "top1_agreement": agreement(ref, var),
            "perplexity": perplexity(var, targets)}


def format_quality(rows: list[dict], accuracy: dict, published: str) -> str:
    lines = [f"{'variant':<16} {'KL nats':>9} {'KL p99':>8} {'top-1 agree':>11} {'perplexity':>10} {'skipped':>8}"]
    for r in rows:
        lines.append(f"{r['variant']:<16} {r['kl_mean']:9.4f} {r['kl_p99']:8.4f} {r['top1_agreement']:11.3f} "
                     f"{r['perplexity']:10.3f} {r.get('skipped', 0):8d}")
    per = accuracy["per_layer"]
    lines.append("commit prediction accuracy per layer (share of true top-k experts predicted): "
                 + " ".join(f"{a:.2f}" for a in per) + f"; mean {np.mean(per):.3f}")
    lines.append("by the predicting router's certainty (top-k softmax mass), quartiles: "
                 + ", ".join(f"{b['certainty_from']:.2f}-{b['certainty_to']:.2f}: {b['accuracy']:.2f}"
                             for b in accuracy["by_certainty"]))
    if accuracy.get("by_distance"):
        lines.append("looking further ahead (layer m+k's router on layer m's MLP input), by k: "
                     + ", ".join(f"{b['distance']}: {b['accuracy']:.2f}" for b in accuracy["by_distance"]))
    lines.append(published)
    return "\n".join(lines)
