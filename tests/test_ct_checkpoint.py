"""A compressed-tensors W4A16 checkpoint (pack-quantized, symmetric, groups of 32), made with the
compressed-tensors library itself, executed as stored: its int4 codes repacked into the slot
layout without requantizing, so the weights the executor runs are bit-identical to what the
library dequantizes, and the logits equal the model whose experts hold those weights."""

from __future__ import annotations

import json

import pytest
import torch

ct = pytest.importorskip("compressed_tensors")

GROUP = 32


def _ct_quantize(w: torch.Tensor, scale_dtype=torch.bfloat16):
    """The library's own quantization and packing of one [out, in] weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    g = w.float().reshape(w.shape[0], -1, GROUP)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    scale = scale.to(scale_dtype)
    q = quantize(w.float(), scale.float(), zp, args).to(torch.int8)
    deq = dequantize(q.float(), scale.float(), zp, args).float()     # fp32: the exact products
    return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}, deq


@pytest.fixture(scope="module")
def ct_checkpoint(int4_checkpoint, tmp_path_factory):
    """int4_checkpoint's Mixtral with every expert in compressed-tensors' pack-quantized format."""
    return _write_ct(int4_checkpoint, tmp_path_factory.mktemp("ct") / "mixtral-ct", torch.bfloat16)


@pytest.fixture(scope="module")
def ct_fp16_checkpoint(int4_checkpoint, tmp_path_factory):
    """The same with fp16 scales, as a model quantized in fp16 stores them (most do not fit bf16)."""
    return _write_ct(int4_checkpoint, tmp_path_factory.mktemp("ct16") / "mixtral-ct", torch.float16)


def _write_ct(src, dst, scale_dtype):
    from safetensors.torch import load_file, save_file
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        if ".experts." not in name:
            out[name] = t
            continue
        if name.endswith((".w1.weight", ".w2.weight", ".w3.weight")):      # per-expert names, as saved
            key = name[: -len(".weight")]
            parts, deq[key] = _ct_quantize(t, scale_dtype)
            out.update({f"{key}.{k}": v for k, v in parts.items()})
        elif name.endswith("gate_up_proj"):               # transformers 5's fused names -> per expert
            layer = name.split(".")[2]
            for e in range(t.shape[0]):
                w1, w3 = t[e].chunk(2, 0)
                for proj, w in (("w1", w1), ("w3", w3)):
                    key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}"
                    parts, deq[key] = _ct_quantize(w, scale_dtype)
                    out.update({f"{key}.{k}": v for k, v in parts.items()})
        elif name.endswith("down_proj"):
            layer = name.split(".")[2]
            for e in range(t.shape[0]):
                key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.w2"
                parts, deq[key] = _ct_quantize(t[e], scale_dtype)
                out.update({f"{key}.{k}": v for k, v in parts.items()})
        else:
            raise AssertionError(f"unexpected expert tensor {name}")
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["re:.*experts.*"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst, deq


def _reference(src, deq):
    """The float model with each expert replaced by the library's dequantized weights."""
    def apply(model):
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                ex = layer.mlp.experts
                for e in range(ex.gate_up_proj.shape[0]):
                    p = f"model.layers.{i}.block_sparse_moe.experts.{e}"
                    ex.gate_up_proj[e] = torch.cat([deq[f"{p}.w1"], deq[f"{p}.w3"]], 0)
                    ex.down_proj[e] = deq[f"{p}.w2"]
    return apply


@pytest.mark.parametrize("kernel", ["loop", "fused"])
def test_compressed_tensors_experts_run_as_stored(int4_checkpoint, ct_checkpoint, kernel):
    from cmoe.executor.moe_kernel import dequantized
    from tests.test_executor import reference_logits, run_exec
    path, deq = ct_checkpoint
    w, results = run_exec(path, ["upper", "ondemand", "static"], fmt=None, kernel=kernel)
    assert w.fmt == "w4g32"
    # the store holds the library's weights bit for bit (read back through cmoe's own layouts)
    store = w.store
    for m, d in enumerate(w.spec.moe_layers):
        p = f"model.layers.{d}.block_sparse_moe.experts.1"
        buf = store.expert(m, 1)
        if store.packing == "tiled":
            w13, w2 = dequantized(buf, store.layout)
        else:                                             # torch's CPU kernel on the identity: the weights
            from cmoe.executor.kernels import ExpertViews, int4_mm
            v = ExpertViews(store.layout, buf, "cpu")
            w13, w2 = (int4_mm(torch.eye(store.layout.part(n).shape[1]),
                               getattr(v, n), GROUP, getattr(v, f"{n}_sz")).T for n in ("w13", "w2"))
        assert torch.equal(w13, torch.cat([deq[f"{p}.w1"], deq[f"{p}.w3"]], 0))
        assert torch.equal(w2, deq[f"{p}.w2"])
    ref = reference_logits(int4_checkpoint, w.prompts, 4, _reference(int4_checkpoint, deq))
    for r in results:
        for a, b in zip(r.logits, ref):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (r.policy, (a - b).abs().max().item())


@pytest.mark.parametrize("kernel", ["loop", "fused"])
def test_fp16_scales_run_exactly_as_w4g32_fp16(int4_checkpoint, ct_fp16_checkpoint, kernel):
    """fp16 scales go to the -fp16 layout (zero point 8) instead of being refused for bf16."""
    from safetensors.torch import load_file

    from tests.test_executor import reference_logits, run_exec
    from tests.test_gptq_checkpoint import store_weights
    path, deq = ct_fp16_checkpoint
    s = torch.cat([v.reshape(-1) for k, v in load_file(str(path / "model.safetensors")).items()
                   if k.endswith("weight_scale")])
    assert not torch.equal(s.to(torch.bfloat16).to(s.dtype), s)          # bf16 would have refused them
    w, results = run_exec(path, ["upper", "static"], fmt=None, kernel=kernel)
    assert w.fmt == "w4g32-fp16"
    for m, d in enumerate(w.spec.moe_layers):
        p = f"model.layers.{d}.block_sparse_moe.experts.3"
        w13, w2 = store_weights(w.store, m, 3)
        assert torch.equal(w13, torch.cat([deq[f"{p}.w1"], deq[f"{p}.w3"]], 0)) and torch.equal(w2, deq[f"{p}.w2"])
    ref = reference_logits(int4_checkpoint, w.prompts, 4, _reference(int4_checkpoint, deq))
    for r in results:
        for a, b in zip(r.logits, ref):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (r.policy, (a - b).abs().max().item())


def test_another_quant_for_stored_experts_is_refused(ct_checkpoint):
    from cmoe.core.errors import CmoeError
    from tests.test_executor import run_exec
    with pytest.raises(CmoeError, match="runs as stored: leave out --quant, or pass --quant w4g32"):
        run_exec(ct_checkpoint[0], ["upper"], fmt="w4g128")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compressed_tensors_experts_run_as_stored_on_cuda(int4_checkpoint, ct_checkpoint):
    """The same checkpoint on the GPU: the store's tiled bytes hold the library's weights bit for
    bit, and the prefill logits (bf16 on the GPU) match the fp32 model with those weights."""
    from cmoe.executor.moe_kernel import dequantized
    from tests.test_executor import assert_prefill_matches, run_exec_cuda
    path, deq = ct_checkpoint
    w, results = run_exec_cuda(path)
    assert w.fmt == "w4g32" and w.store.packing == "tiled"
    for m, d in enumerate(w.spec.moe_layers):
        p = f"model.layers.{d}.block_sparse_moe.experts.2"
        w13, w2 = dequantized(w.store.expert(m, 2).cuda(), w.store.layout)
        assert torch.equal(w13.cpu(), torch.cat([deq[f"{p}.w1"], deq[f"{p}.w3"]], 0))
        assert torch.equal(w2.cpu(), deq[f"{p}.w2"])
    assert_prefill_matches(results, w.prompts, int4_checkpoint, _reference(int4_checkpoint, deq))
