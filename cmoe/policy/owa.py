"""Output Weight Adjustment (OWA): a token that computes only the committed experts re-weights
their outputs with the true router scores restricted to the committed set.

For committed set C and true router scores s (softmax or sigmoid, over all experts):
    w_c = s_c / sum_{j in C} s_j * mass,     c in C,
where `mass` is the total weight exact routing would have applied: 1 when the model renormalises
its top-k (Mixtral, Qwen3 with norm_topk_prob), else the sum of the true top-k scores; times the
model's routed scaling factor (DeepSeek). With C equal to the true top-k, OWA returns exactly the
exact-routing weights, so a right prediction changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def owa_weights(scores: Sequence[float], committed: Sequence[int], top_k: int, renormalize: bool,
                scaling: float = 1.0) -> list[float]:
    assert committed, "OWA needs at least one committed expert"
    top = sorted(scores, reverse=True)[:top_k]
    mass = (1.0 if renormalize else sum(top)) * scaling
    total = sum(scores[c] for c in committed)
    if total <= 0:
        return [mass / len(committed)] * len(committed)
    return [scores[c] / total * mass for c in committed]
