"""Exact expert bytes, checked against sizes computed by hand and against safetensors headers."""

import numpy as np
import pytest

from cmoe.core.checkpoint import checkpoint_expert_bytes, checkpoint_expert_tensors, detect_expert_format
from cmoe.core.errors import CmoeError
from cmoe.core.padding import SLOT_ALIGN, padding_table
from cmoe.core.quant import QuantRecipe, expert_bytes, non_expert_bytes, recipe, tensor_bytes
from tests.gptq_pack import gptq_dequantize, gptq_tensors
from cmoe.core.spec import preset


def test_mixtral_w4a16_expert_by_hand():
    # w1, w3: 14336 x 4096; w2: 4096 x 14336; 4-bit weights + bf16 scale and zero per 128 inputs
    w13 = 14336 * 4096 // 2 + (4096 // 128) * 14336 * 4
    w2 = 4096 * 14336 // 2 + (14336 // 128) * 4096 * 4
    per_expert = 2 * w13 + w2
    assert per_expert == 93_585_408                     # about 94 MB, as DESIGN.md says
    sizes = expert_bytes(preset("mixtral-8x7b"), recipe("w4a16"))
    assert sizes == [[per_expert] * 8] * 32


def test_deepseek_lite_w4a16_and_bf16_by_hand():
    s = preset("deepseek-v2-lite")
    w4 = 2 * (1408 * 2048 // 2 + 16 * 1408 * 4) + (2048 * 1408 // 2 + 11 * 2048 * 4)
    assert expert_bytes(s, recipe("w4a16"))[5][17] == w4 == 4_595_712
    assert expert_bytes(s, recipe("bf16"))[0][0] == 3 * 1408 * 2048 * 2


def test_mixed_recipe_sizes_by_hand():
    s = preset("mixtral-8x7b")
    rec = recipe("mixed")                        # 1/4 at w8g128, 1/4 at w3g128, the rest w4g128
    f, h = 14336, 4096
    def grouped(bits):
        return 2 * (f * h * bits // 8 + (h // 128) * f * 4) + (h * f * bits // 8 + (f // 128) * h * 4)
    sizes = expert_bytes(s, rec)
    for m in (0, 17, 31):
        fmts = rec.expert_formats(8, m)
        assert sorted(fmts) == ["w3g128"] * 2 + ["w4g128"] * 4 + ["w8g128"] * 2
        assert sizes[m] == [grouped(int(fm[1])) for fm in fmts]
    assert rec.expert_formats(8, 3) == recipe("mixed").expert_formats(8, 3)   # seeded, stable
    assert rec.expert_formats(8, 3) != rec.expert_formats(8, 4) or rec.expert_formats(8, 5) != rec.expert_formats(8, 4)


def test_padding_statistics():
    sizes = [[100, 300, 200, 1000], [512, 512, 512, 512]]
    a, b = padding_table(sizes)
    assert a.slot_bytes == 1024 and a.min_bytes == 100 and a.max_bytes == 1000
    assert a.waste_bytes == 4 * 1024 - 1600
    assert a.std_bytes == pytest.approx(np.std([100, 300, 200, 1000]))
    assert a.waste_fraction == pytest.approx((4096 - 1600) / 4096)
    assert b.slot_bytes == 512 and b.waste_bytes == 0 and SLOT_ALIGN == 256


def test_formats_and_recipe_parsing():
    assert tensor_bytes("w8a8", 10, 20) == {"weight": 200, "weight_scale": 20}
    assert tensor_bytes("awq-w4g128", 256, 128) == {"qweight": 128 * 128, "qzeros": 128, "scales": 512}
    r = recipe("w4g64+w8g64:0.5,attention=bf16")
    assert r.expert == "w4g64" and r.mixed == (("w8g64", 0.5),) and r.attention == "bf16"
    with pytest.raises(CmoeError, match="unknown quantization format 'w9g1'"):
        recipe("w4g128+w9g1:0.5")
    with pytest.raises(CmoeError, match="sum to at most 1"):
        QuantRecipe("x", mixed=(("w8g128", 0.7), ("w3g128", 0.7)))


def test_non_expert_bytes_mixtral():
    ne = non_expert_bytes(preset("mixtral-8x7b"), recipe("w4a16"))
    # W8A8 attention: q,o 4096x4096, k,v 1024x4096 int8 plus a bf16 scale per output row
    attn = (2 * 4096 * 4096 + 2 * 1024 * 4096) + 2 * (4096 + 4096 + 1024 + 1024)
    assert ne["attention"] == 32 * attn
    assert ne["embeddings"] == 2 * 32000 * 4096 * 2 and ne["router"] == 32 * 8 * 4096 * 2


def _quantize_checkpoint(src, dst, rec):
    """Quantize the experts of a saved checkpoint with `rec` (GPTQ layout) and save it."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file
    from cmoe.core.checkpoint import _PER_EXPERT
    from cmoe.core.spec import from_checkpoint
    spec = from_checkpoint(src)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        m = _PER_EXPERT.match(name)
        if not m:
            out[name] = w
            continue
        layer, e = int(m.group(1)), int(m.group(2))
        fmt = rec.expert_formats(spec.num_experts, spec.moe_layers.index(layer))[e]
        bits, group = int(fmt.split("-w")[1].split("g")[0]), int(fmt.split("g")[-1])
        stem = name[: -len(".weight")]
        for k, v in gptq_tensors(w, bits, group).items():
            out[f"{stem}.{k}"] = v
    save_file(out, str(dst / "model.safetensors"))
    return spec, json.loads((dst / "config.json").read_text())


def test_sizes_match_headers_of_a_quantized_checkpoint(checkpoints, tmp_path):
    rec = QuantRecipe("t", expert="gptq-w4g16", attention="bf16", mixed=(("gptq-w8g16", 0.25), ("gptq-w2g16", 0.25)))
    spec, _ = _quantize_checkpoint(checkpoints["mixtral"], tmp_path / "q", rec)
    from_headers = checkpoint_expert_bytes(tmp_path / "q", spec)
    assert from_headers == expert_bytes(spec, rec)
    # by hand for the 8-bit experts: w1/w3 48x32, w2 32x48, groups of 16
    w13 = 32 * 48 + (32 // 16) * 48 * 1 + (32 // 16) * 48 * 2 + 32 * 4
    w2 = 48 * 32 + (48 // 16) * 32 * 1 + (48 // 16) * 32 * 2 + 48 * 4
    fmts = rec.expert_formats(spec.num_experts, 0)
    assert from_headers[0][fmts.index("gptq-w8g16")] == 2 * w13 + w2
    assert detect_expert_format(tmp_path / "q", spec) == fmts[0]


def test_quantized_weights_are_accurate():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    for bits, tol in ((8, 0.01), (4, 0.15)):
        r = gptq_dequantize(gptq_tensors(w, bits, 128), bits, 128, 64)
        assert np.linalg.norm(r - w) / np.linalg.norm(w) < tol


def test_plain_checkpoint_sizes_from_headers(checkpoints):
    from cmoe.core.spec import from_checkpoint
    for family in ("mixtral", "deepseek_v2", "qwen2_moe"):
        spec = from_checkpoint(checkpoints[family])
        t = checkpoint_expert_tensors(checkpoints[family], spec)
        f, h = spec.expert_ffn, spec.hidden
        assert t[0][0] == {"w1.weight": f * h * 4, "w3.weight": f * h * 4, "w2.weight": h * f * 4}


def test_pickle_only_checkpoint_is_refused(tmp_path):
    from cmoe.core.checkpoint import safetensors_files
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CmoeError, match="only pickle weights"):
        safetensors_files(tmp_path)
    assert safetensors_files(tmp_path, allow_pickle=True) == []
