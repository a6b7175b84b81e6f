"""A synthetic trace's measured statistics come out within stated tolerances of its parameters."""

import numpy as np
import pytest

from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.trace import bundle
from cmoe.trace.stats import layer_stats, random_rep_any, summary
from cmoe.trace.synthetic import SyntheticParams, generate, popularity

# tolerances: 4 x the binomial standard error at these sizes, rounded up
REP_TOL, ACC_TOL, ENT_TOL = 0.04, 0.015, 0.01


def test_measured_statistics_match_parameters():
    spec = preset("mixtral-8x7b")
    p = SyntheticParams(requests=16, prompt_len=16, decode_len=240, skew=0.5, pred_acc=0.9, seed=3)
    t = generate(spec, recipe("w4a16"), p)
    layers = layer_stats(t)
    target = p.repetition_at(spec.num_moe_layers)
    assert target[0] == pytest.approx(0.14) and target[-1] == pytest.approx(0.23)
    for m, x in enumerate(layers):
        assert abs(x.rep_first - target[m]) < REP_TOL, (m, x.rep_first, target[m])
        assert abs(x.pred_acc - 0.9) < ACC_TOL
    rng = np.random.default_rng(p.seed)
    pops = [popularity(8, 0.5, rng) for _ in range(32)]
    for x, pop in zip(layers, pops):
        want = -(pop * np.log(pop)).sum() / np.log(8)
        assert abs(x.entropy - want) < ENT_TOL
    s = summary(t, layers)
    assert s["random_rep_any"] == pytest.approx(1 - 15 / 28)
    assert s["expert_bytes_per_token"] == 32 * 2 * 93_585_408


def test_uniform_no_repetition_matches_random_baselines():
    spec = preset("olmoe-1b-7b")
    p = SyntheticParams(requests=8, prompt_len=0, decode_len=400, skew=0.0, repetition=((0, 0.0), (1, 0.0)))
    s = summary(generate(spec, recipe("w4a16"), p))
    assert abs(s["rep_any"] - random_rep_any(64, 8)) < 0.03
    assert s["max_load"] < 1.25 and s["entropy"] > 0.995


def test_same_seed_gives_byte_identical_bundles(tmp_path):
    spec, rec = preset("deepseek-v2-lite"), recipe("mixed")
    bundle.write(generate(spec, rec, SyntheticParams(seed=5)), tmp_path / "a")
    bundle.write(generate(spec, rec, SyntheticParams(seed=5)), tmp_path / "b")
    bundle.write(generate(spec, rec, SyntheticParams(seed=6)), tmp_path / "c")
    for f in ("routes.safetensors", "meta.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a" / "routes.safetensors").read_bytes() != (tmp_path / "c" / "routes.safetensors").read_bytes()


def test_routes_are_valid_and_sorted_by_weight():
    t = generate(preset("qwen1.5-moe-a2.7b"), recipe("w4a16"), SyntheticParams(requests=2))
    bundle.validate(t)
    assert (np.diff(t.weights, axis=-1) <= 0).all()
    assert (t.pred_experts >= 0).all()


def test_accuracy_by_distance_follows_its_parameters_and_leaves_distance_1_alone():
    spec = preset("mixtral-8x7b")
    p = SyntheticParams(requests=16, prompt_len=16, decode_len=240, pred_acc=0.9, seed=3)
    t = generate(spec, recipe("w4a16"), p)
    assert p.ahead_ratio == (0.914, 0.828, 0.766) and p.ahead_copy == 0.45 and t.depth == 4
    for k, want in enumerate((0.9, 0.9 * 0.914, 0.9 * 0.828, 0.9 * 0.766), start=1):
        a = t.pred_ahead[:, k - 1:, k - 1]                      # layers m >= k-1 have a layer m-k
        got = (t.experts[:, k - 1:, :, None] == a[..., None, :]).any(-1).mean()
        assert abs(got - want) < ACC_TOL, (k, got, want)
        assert (t.pred_ahead[:, : k - 1, k - 1] == -1).all() and (a >= 0).all()
    flat = generate(spec, recipe("w4a16"), SyntheticParams(requests=16, prompt_len=16, decode_len=240, pred_acc=0.9,
                                                           seed=3, ahead_ratio=()))
    assert flat.pred_ahead is None and flat.depth == 1
    for k in ("experts", "weights", "pred_experts"):            # the deeper draws change nothing else
        assert np.array_equal(getattr(flat, k), getattr(t, k))
    again = generate(spec, recipe("w4a16"), p)
    assert np.array_equal(again.pred_ahead, t.pred_ahead)


def test_nearby_distances_agree_as_on_the_embedded_model():
    """The top-1 of distances k and k+1 agree about as often as on the embedded model's trace (0.73,
    0.77, 0.72 at k = 1, 2, 3: mean 0.74); independent draws (ahead_copy 0) agree far less often."""
    spec = preset("mixtral-8x7b")

    def agreement(copy):
        t = generate(spec, recipe("w4a16"), SyntheticParams(requests=8, ahead_copy=copy))
        a = t.pred_ahead[t.phase == 1]
        return [float((a[:, k:, k - 1, 0] == a[:, k:, k, 0]).mean()) for k in (1, 2, 3)]
    assert np.allclose(agreement(0.45), [0.79, 0.73, 0.70], atol=0.02)
    assert np.allclose(agreement(0.0), [0.67, 0.56, 0.48], atol=0.02)


def test_a_ratio_past_certainty_is_refused():
    from cmoe.core.errors import CmoeError
    with pytest.raises(CmoeError, match="ahead_ratio values must be >= 0"):
        SyntheticParams(pred_acc=0.9, ahead_ratio=(1.2,))
    with pytest.raises(CmoeError, match="ahead_copy must lie in"):          # copies of 0.9 cannot fall to 0.1
        SyntheticParams(pred_acc=0.9, ahead_ratio=(0.1,), ahead_copy=0.5)
