"""cmoe quality: the metrics on hand-made distributions, and the teacher-forced runs on a real
(tiny) checkpoint, where exact routing must give KL 0 and agreement 1 against itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cmoe.quality.measures import agreement, compare, kl_divergence, perplexity


def test_kl_by_hand():
    p = np.log(np.array([[0.5, 0.25, 0.25]]))
    q = np.log(np.array([[0.25, 0.5, 0.25]]))
    want = 0.5 * math.log(2) + 0.25 * math.log(0.5)               # = 0.25 ln 2
    assert kl_divergence(p, q)[0] == pytest.approx(want)
    assert kl_divergence(p, p)[0] == pytest.approx(0.0, abs=1e-15)
    assert kl_divergence(p + 7.0, q - 3.0)[0] == pytest.approx(want)   # logits: shift-invariant


def test_agreement_and_perplexity_by_hand():
    a = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0]])
    b = np.array([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.0, 5.0]])
    assert agreement(a, b) == pytest.approx(2 / 3)
    assert agreement(a, a) == 1.0
    uniform = np.zeros((4, 8))
    assert perplexity(uniform, np.array([0, 3, 5, 7])) == pytest.approx(8.0)
    row = compare(a, a, np.array([0, 1, 2]))
    assert row["kl_mean"] == pytest.approx(0.0, abs=1e-12) and row["top1_agreement"] == 1.0


def test_teacher_forced_runs_on_a_checkpoint(checkpoints):
    from cmoe.quality.run import run_quality
    text = list(b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    res = run_quality(checkpoints["mixtral"], [t % 64 for t in text], 40, ["commit", "commit-no-owa"])
    rows = {r["variant"]: r for r in res["rows"]}
    assert res["tokens"] == 40
    assert rows["exact"]["kl_mean"] == 0.0 and rows["exact"]["top1_agreement"] == 1.0 and rows["exact"]["skipped"] == 0
    # this seeded model's router is nearly uniform: 12 routed experts skipped, a tiny but nonzero KL
    assert 0 < rows["commit"]["kl_mean"] < 1e-4 and 0 < rows["commit-no-owa"]["kl_mean"] < 1e-4
    assert rows["commit"]["kl_mean"] != rows["commit-no-owa"]["kl_mean"]            # OWA changes the weights
    assert rows["commit"]["skipped"] == rows["commit-no-owa"]["skipped"] == 12     # same predictions, same misses
    acc = res["pred_accuracy"]
    assert acc["per_layer"] == pytest.approx([82 / 82, 79 / 82, 73 / 82])       # 41 tokens x top-2 per layer
    assert sum(b["n"] for b in acc["by_certainty"]) == 3 * 41            # every (token, layer) of the 41 once


def test_prediction_accuracy_by_distance(checkpoints):
    """Distance 1 is the commit prediction: the same share as the per-layer accuracy of every layer
    but the first (whose prediction has another source); further distances are measured too."""
    import numpy as np

    from cmoe.quality.run import prediction_accuracy
    ids = list(range(1, 40))
    acc = prediction_accuracy(checkpoints["deepseek_v2"], ids, "cpu")        # a dense layer, then 2 MoE layers
    d = acc["by_distance"]
    assert [x["distance"] for x in d] == [1] and d[0]["pairs"] == 1
    assert d[0]["accuracy"] == pytest.approx(float(np.mean(acc["per_layer"][1:])))
    acc6 = prediction_accuracy(checkpoints["olmoe"], ids, "cpu")             # 3 MoE layers
    assert [(x["distance"], x["pairs"]) for x in acc6["by_distance"]] == [(1, 2), (2, 1)]
    assert acc6["by_distance"][0]["accuracy"] == pytest.approx(float(np.mean(acc6["per_layer"][1:])))
    assert all(0.0 <= x["accuracy"] <= 1.0 for x in acc6["by_distance"])


def test_adaptive_is_scored_under_half_a_pool(checkpoints):
    """adaptive skips only what is not resident, so it is scored with half of each layer's experts
    in the pool (with all of them it would be exact); its skips change the logits."""
    from cmoe.quality.run import run_quality
    text = list(b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    res = run_quality(checkpoints["mixtral"], [t % 64 for t in text], 40, ["adaptive"])
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["exact"]["skipped"] == 0
    # the seeded model (4 experts, top-2, 2 slots a layer): 60 of 240 routed choices skipped, 1 of 40
    # top-1 tokens changed
    assert rows["adaptive"]["skipped"] == 60 and rows["adaptive"]["top1_agreement"] == 0.975
    assert 0 < rows["adaptive"]["kl_mean"] < 1e-4
