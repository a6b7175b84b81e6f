"""Calibrated synthetic traces for models whose weights cannot be fetched here.

Each statistic is set by a parameter with a published default:
- load skew: expert popularity in each layer follows a Zipf law with exponent `skew`, ranks
  shuffled per layer. Mixtral's load is close to uniform (Mixtral paper, section 5), hence 0.2.
- repetition of the first expert between consecutive tokens of one request, per layer, linear
  between anchors (layer position 0..1 -> rate). Default: Mixtral paper, Table 5: 14% at layer 0,
  about 26% at layer 15 (24-28%), about 23% at layer 31 (20-26%); random is 1/E = 12.5%.
- commit-prediction accuracy `pred_acc`: each true expert is in the prediction with this
  probability (published next-layer predictors: about 80% from the previous gate, FATE-style,
  93-97% for trained pre-attention predictors); default 0.85.
- accuracy by distance `ahead_ratio`: the prediction for layer m made k layers earlier (from
  layer m-k's hidden state) keeps each true expert with probability pred_acc * ahead_ratio[k-2],
  k = 2..1+len(ahead_ratio). Default from the embedded model (the one retrained on the H200,
  2026-12-02), where the router of layer m+k applied to layer m's hidden state holds 0.744, 0.680,
  0.616, 0.570 of the true top-2 at k = 1..4 (`cmoe quality`: teacher-forced held-out text):
  ratios 0.914, 0.828, 0.766 of distance 1. (Over the greedy decode tokens of the shipped trace the
  decay is slower: 0.742, 0.664, 0.647, 0.637.) Distance 1 is `pred_experts`, drawn as
  before; the deeper ones come from their own seeded stream, so they change nothing else.

Sampling without replacement proportional to popularity is done for all tokens and layers at once
with the Gumbel-top-k trick. Repetition is forced with probability q, solved from
rate = q + (1 - q) * sum(p^2) so that the *measured* rate is the target. Seeded: the same
parameters give byte-identical traces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from cmoe.core.errors import CmoeError
from cmoe.core.quant import QuantRecipe, expert_bytes
from cmoe.core.spec import ModelSpec
from cmoe.trace.bundle import DECODE, PREFILL, Trace

MIXTRAL_REPETITION = ((0.0, 0.14), (0.5, 0.26), (1.0, 0.23))
EMBEDDED_AHEAD = (0.914, 0.828, 0.766)    # accuracy at distance 2, 3, 4 over distance 1's (0.680, 0.616, 0.570 / 0.744)
AHEAD_COPY = 0.45                          # the embedded trace's top-1 agreement of distances k, k+1: 0.73, 0.77, 0.72
                                           # (mean 0.74; the synthetic Mixtral's: 0.79, 0.73, 0.69, mean 0.74)


@dataclass(frozen=True)
class SyntheticParams:
    requests: int = 4
    prompt_len: int = 64
    decode_len: int = 256
    skew: float = 0.2                     # Zipf exponent of expert popularity; 0 = uniform
    repetition: tuple[tuple[float, float], ...] = MIXTRAL_REPETITION
    pred_acc: float = 0.85
    seed: int = 0
    ahead_ratio: tuple[float, ...] = EMBEDDED_AHEAD   # () keeps distance 1 only
    ahead_copy: float = AHEAD_COPY        # share of (token, layer) whose prediction at k repeats k-1's

    def __post_init__(self) -> None:
        if self.requests < 1 or self.prompt_len < 0 or self.decode_len < 0 or self.prompt_len + self.decode_len < 1:
            raise CmoeError("synthetic trace needs at least one request of at least one token")
        if not 0 <= self.pred_acc <= 1 or self.skew < 0:
            raise CmoeError("pred_acc must lie in [0, 1] and skew must be >= 0")
        if any(not 0 <= r * self.pred_acc <= 1 or r < 0 for r in self.ahead_ratio):
            raise CmoeError("ahead_ratio values must be >= 0 and keep pred_acc * ratio within [0, 1]")
        if not 0 <= self.ahead_copy < 1 or any(not 0 <= x <= 1 for x in self._fresh_acc()):
            raise CmoeError("ahead_copy must lie in [0, 1) and leave each distance's fresh draws an accuracy "
                            "within [0, 1]")
        if any(not 0 <= r < 1 for _, r in self.repetition):
            raise CmoeError("repetition rates must lie in [0, 1)")

    def _fresh_acc(self) -> list[float]:
        """The accuracy of the rows drawn afresh at distance 2, 3, ..., so that with the copied rows
        (accuracy of distance k-1) the distance's accuracy is pred_acc * ratio."""
        accs = [self.pred_acc] + [self.pred_acc * r for r in self.ahead_ratio]
        c = self.ahead_copy
        return [(b - c * a) / (1 - c) for a, b in zip(accs, accs[1:])]

    def repetition_at(self, num_layers: int) -> np.ndarray:
        xs, ys = zip(*self.repetition)
        pos = np.linspace(0, 1, num_layers) if num_layers > 1 else np.zeros(1)
        return np.interp(pos, xs, ys)


def popularity(num_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    p = 1.0 / np.arange(1, num_experts + 1) ** skew
    return rng.permutation(p / p.sum())


def _gumbel_topk(logp: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    keys = logp + rng.gumbel(size=logp.shape)
    return np.argsort(-keys, axis=-1, kind="stable")[..., :k]


def _layout(p: SyntheticParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = p.prompt_len + p.decode_len
    request = np.repeat(np.arange(p.requests, dtype=np.int32), n)
    step = np.tile(np.arange(n, dtype=np.int32), p.requests)
    phase = np.where(step < p.prompt_len, PREFILL, DECODE).astype(np.uint8)
    return request, step, phase


def _first_experts(pop: np.ndarray, rates: np.ndarray, step: np.ndarray, rng) -> np.ndarray:
    """[T, M] first expert of each token, repeating the previous token's with the target rate."""
    T, M = step.size, pop.shape[0]
    fresh = _gumbel_topk(np.broadcast_to(np.log(pop), (T, *pop.shape)), 1, rng)[..., 0]   # [T, M]
    chance = (pop ** 2).sum(1)                                                         # [M]
    q = np.clip((rates - chance) / (1 - chance), 0, 1)
    repeat = (rng.random((T, M)) < q) & (step[:, None] > 0)
    src = np.where(repeat, 0, np.arange(T)[:, None])
    src = np.maximum.accumulate(src, axis=0)          # index of the last fresh token, per layer
    return np.take_along_axis(fresh, src, axis=0)


def _predictions(experts: np.ndarray, E: int, acc: float, rng) -> np.ndarray:
    T, M, K = experts.shape
    keys = rng.random((T, M, E))
    np.put_along_axis(keys, experts.astype(np.int64), -1.0, axis=-1)
    others = np.argsort(-keys, axis=-1, kind="stable")[..., :K]        # distinct, not chosen
    keep = rng.random((T, M, K)) < acc
    if K == E:
        keep[:] = True
    return np.where(keep, experts, others)


def generate(spec: ModelSpec, rec: QuantRecipe, p: SyntheticParams = SyntheticParams()) -> Trace:
    rng = np.random.default_rng(p.seed)
    M, E, K = spec.num_moe_layers, spec.num_experts, spec.top_k
    request, step, phase = _layout(p)
    T = step.size
    pop = np.stack([popularity(E, p.skew, rng) for _ in range(M)])     # [M, E]
    first = _first_experts(pop, p.repetition_at(M), step, rng)         # [T, M]
    logp = np.broadcast_to(np.log(pop), (T, M, E)).copy()
    np.put_along_axis(logp, first[..., None], -np.inf, axis=-1)
    rest = _gumbel_topk(logp, K - 1, rng)                              # [T, M, K-1]
    experts = np.concatenate([first[..., None], rest], -1).astype(np.int16)
    w = -np.sort(-rng.gamma(2.0, size=(T, M, K)), axis=-1)
    w = w / w.sum(-1, keepdims=True)
    if not spec.renormalize:
        w = w * rng.uniform(0.3, 0.9, size=(T, M, 1))                   # top-k mass of the softmax
    w = (w * spec.scaling).astype(np.float32)
    pred = _predictions(experts, E, p.pred_acc, rng).astype(np.int16)
    src = {"kind": "synthetic", "params": {**asdict(p), "repetition": [list(r) for r in p.repetition],
                                           "ahead_ratio": list(p.ahead_ratio)}}
    return Trace(experts=experts, weights=w, pred_experts=pred, request=request, step=step, phase=phase,
                 spec=spec, recipe=rec, expert_bytes=expert_bytes(spec, rec), source=src,
                 pred_ahead=_ahead(experts, pred, E, p) if p.ahead_ratio else None)


def _ahead(experts: np.ndarray, pred: np.ndarray, E: int, p: SyntheticParams) -> np.ndarray:
    """[T, M, D, K] predictions by distance: distance 1 is `pred`; at distance k a share
    `ahead_copy` of the (token, layer) rows repeats distance k-1's (predictions made from nearby
    states agree more often than independent guesses would), the rest is drawn afresh, so that
    the accuracy is pred_acc * ahead_ratio[k-2]; -1 where m < k-1 (no state that far back)."""
    rng = np.random.default_rng([p.seed, 1])       # its own stream: distance 1 and the routes stay as they were
    out, prev = [pred], pred
    for k, acc in enumerate(p._fresh_acc(), start=2):
        drawn = _predictions(experts, E, acc, rng).astype(np.int16)      # within [0, 1]: __post_init__
        prev = np.where(rng.random(experts.shape[:2] + (1,)) < p.ahead_copy, prev, drawn)
        a = prev.copy()
        a[:, : k - 1] = -1
        out.append(a)
    return np.stack(out, 2)
