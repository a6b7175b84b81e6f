import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.spec import PRESETS, from_checkpoint, from_config, preset
from tests.conftest import FAMILIES, tiny_config


def test_presets_carry_published_values():
    m = preset("mixtral-8x7b")
    assert (m.num_layers, m.hidden, m.expert_ffn, m.num_experts, m.top_k) == (32, 4096, 14336, 8, 2)
    x = preset("mixtral-8x22b")
    assert (x.num_layers, x.hidden, x.expert_ffn, x.num_experts, x.top_k) == (56, 6144, 16384, 8, 2)
    d = preset("deepseek-v2-lite")
    assert (d.num_layers, d.hidden, d.expert_ffn, d.num_experts, d.top_k, d.dense_ffn) == (27, 2048, 1408, 64, 6, 10944)
    assert d.moe_layers[0] == 1 and d.num_moe_layers == 26 and d.shared_ffn == 2 * 1408 and d.is_mla
    q = preset("qwen1.5-moe-a2.7b")
    assert (q.num_layers, q.hidden, q.expert_ffn, q.num_experts, q.top_k, q.shared_ffn) == (24, 2048, 1408, 60, 4, 5632)
    o = preset("olmoe-1b-7b")
    assert (o.num_layers, o.hidden, o.expert_ffn, o.num_experts, o.top_k) == (16, 2048, 1024, 64, 8)
    assert not o.renormalize and m.renormalize


def test_unknown_preset_is_one_line():
    with pytest.raises(CmoeError, match="unknown model preset 'gpt-9'"):
        preset("gpt-9")


@pytest.mark.parametrize("family", FAMILIES)
def test_from_config_of_every_family(family):
    pytest.importorskip("transformers")
    s = from_config(tiny_config(family).to_dict(), name="t")
    assert s.family == family and s.hidden == 32 and s.num_layers == 3
    expected = {"mixtral": (4, 2, 48, (0, 1, 2)), "deepseek_v2": (8, 3, 16, (1, 2)), "deepseek_v3": (8, 2, 16, (1, 2)),
                "qwen2_moe": (8, 2, 16, (0, 1, 2)), "qwen3_moe": (8, 2, 16, (0, 1, 2)), "olmoe": (8, 2, 16, (0, 1, 2))}
    assert (s.num_experts, s.top_k, s.expert_ffn, s.moe_layers) == expected[family]
    assert s.scoring == ("sigmoid" if family == "deepseek_v3" else "softmax")


def test_qwen_sparse_step_and_mlp_only_layers():
    cfg = {"model_type": "qwen2_moe", "num_hidden_layers": 6, "hidden_size": 8, "num_attention_heads": 2,
           "vocab_size": 10, "num_experts_per_tok": 2, "num_experts": 4, "moe_intermediate_size": 4,
           "intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert from_config(cfg).moe_layers == (1, 5)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    with pytest.raises(CmoeError, match="unsupported architecture 'llama'"):
        from_checkpoint(tmp_path)


def test_spec_round_trips_through_dict():
    for s in PRESETS.values():
        assert type(s).from_dict(s.to_dict()) == s


def test_absurd_spec_values_are_refused():
    with pytest.raises(CmoeError, match="top_k 9 exceeds 8 experts"):
        preset("mixtral-8x7b").__class__(**{**preset("mixtral-8x7b").to_dict(), "top_k": 9, "moe_layers": (0,)})
