"""GPTQ (4-bit, desc_act off, symmetric and not, both zero-point layouts) and AWQ (gemm, 4-bit)
checkpoints, executed as stored: their codes, fp16 scales and zero points are unpacked into the
w4g32-fp16 slot layout without requantizing, so the weights the executor runs are bit-identical
to the checkpoint's own dequantized weights (q - z) * s, and the logits equal the fp32 model whose
experts hold those weights.

The fixtures are packed by tests/gptq_pack.py, which follows the libraries' documented layouts
(AutoGPTQ/GPTQModel's qweight/qzeros, AutoAWQ's gemm nibble order); tests/test_gptq_library.py
checks it against GPTQModel itself where that library is installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests import gptq_pack

GROUP = 32
BASE = {"bits": 4, "group_size": GROUP}
# kind -> (quantization_config, pack one [out, in] weight -> (tensors, dequantized fp32 [out, in]))
KINDS = {
    "gptq": ({"quant_method": "gptq", **BASE, "desc_act": False, "sym": False, "checkpoint_format": "gptq"},
             lambda w: _gptq(w, sym=False, checkpoint_format="gptq")),
    "gptq-sym": ({"quant_method": "gptq", **BASE, "desc_act": False, "sym": True},     # no layout named: the original
                 lambda w: _gptq(w, sym=True, checkpoint_format="gptq")),
    "gptq_v2": ({"quant_method": "gptq", **BASE, "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"},
                lambda w: _gptq(w, sym=False, checkpoint_format="gptq_v2")),
    "awq": ({"quant_method": "awq", **BASE, "version": "gemm", "zero_point": True}, lambda w: _awq(w)),
}


def _gptq(w: torch.Tensor, sym: bool, checkpoint_format: str):
    t = gptq_pack.gptq_tensors(w.numpy(), 4, GROUP, sym=sym, checkpoint_format=checkpoint_format)
    deq = gptq_pack.gptq_dequantize(t, 4, GROUP, w.shape[0], checkpoint_format=checkpoint_format)
    return {k: torch.from_numpy(v) for k, v in t.items()}, torch.from_numpy(np.ascontiguousarray(deq))


def _awq(w: torch.Tensor):
    t = gptq_pack.awq_tensors(w.numpy(), GROUP)
    deq = gptq_pack.awq_dequantize(t, GROUP)
    return {k: torch.from_numpy(v) for k, v in t.items()}, torch.from_numpy(np.ascontiguousarray(deq))


_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _expert_matrices(sd: dict):
    """(layer, expert, proj, weight [out, in]) of every expert matrix, from per-expert names (as
    transformers saves Mixtral) or fused `gate_up_proj`/`down_proj` [E, ...] tensors."""
    for name, t in sd.items():
        parts = name.split(".")
        layer = parts[2]
        if name.endswith(".weight"):
            yield layer, int(parts[5]), _PROJ[parts[6]], t
        elif name.endswith("gate_up_proj"):
            for e in range(t.shape[0]):
                for proj, w in zip(("gate_proj", "up_proj"), t[e].chunk(2, 0)):
                    yield layer, e, proj, w
        else:
            assert name.endswith("down_proj"), name
            for e in range(t.shape[0]):
                yield layer, e, "down_proj", t[e]


def write_quantized(src, dst, kind: str, edit=None):
    """src with every expert matrix packed as `kind`, under the per-expert names GPTQModel saves
    (`model.layers.L.mlp.experts.E.gate_proj.qweight`, ...). Returns the dequantized weights by
    'layer.expert.proj'. edit(name, tensors) may change a matrix's tensors."""
    from safetensors.torch import load_file, save_file
    qc, pack = KINDS[kind]
    sd = load_file(str(src / "model.safetensors"))
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    deq = {}
    for layer, e, proj, w in _expert_matrices({k: v for k, v in sd.items() if ".experts." in k}):
        key = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        parts, deq[f"{layer}.{e}.{proj}"] = pack(w.float().contiguous())
        if edit:
            edit(key, parts)
        out.update({f"{key}.{k}": v.contiguous() for k, v in parts.items()})
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    return deq


@pytest.fixture(scope="module")
def quantized(int4_checkpoint, tmp_path_factory):
    """kind -> (checkpoint dir, dequantized weights), int4_checkpoint's Mixtral packed each way."""
    root = tmp_path_factory.mktemp("gptq")
    return {k: (root / k, write_quantized(int4_checkpoint, root / k, k)) for k in KINDS}


def expert_weights(deq, d: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = f"{d}.{e}"
    return torch.cat([deq[f"{p}.gate_proj"], deq[f"{p}.up_proj"]], 0), deq[f"{p}.down_proj"]


def replace_experts(deq):
    def apply(model):
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                ex = layer.mlp.experts
                for e in range(ex.gate_up_proj.shape[0]):
                    ex.gate_up_proj[e], ex.down_proj[e] = expert_weights(deq, i, e)
    return apply


def store_weights(store, m: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert (m, e)'s weights as the store's kernels compute with them: the tiled layout read back,
    or torch's CPU int4 kernel applied to the identity."""
    from cmoe.executor.kernels import ExpertViews, int4_mm
    from cmoe.executor.moe_kernel import dequantized
    buf = store.expert(m, e)
    if store.packing == "tiled":
        return dequantized(buf.cpu(), store.layout)
    v = ExpertViews(store.layout, buf, "cpu")
    return tuple(int4_mm(torch.eye(store.layout.part(n).shape[1]), getattr(v, n), store.layout.group,
                         getattr(v, f"{n}_sz")).T for n in ("w13", "w2"))


@pytest.mark.parametrize("kernel", ["loop", "fused"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_gptq_and_awq_experts_run_as_stored(int4_checkpoint, quantized, kind, kernel):
    from tests.test_executor import reference_logits, run_exec
    path, deq = quantized[kind]
    w, results = run_exec(path, ["upper", "ondemand", "static"], fmt=None, kernel=kernel)
    assert w.fmt == "w4g32-fp16" and w.store.packing == ("tiled" if kernel == "fused" else "cpu")
    for m, d in enumerate(w.spec.moe_layers):
        for e in range(w.spec.num_experts):
            w13, w2 = store_weights(w.store, m, e)
            want13, want2 = expert_weights(deq, d, e)
            assert torch.equal(w13, want13) and torch.equal(w2, want2), (m, e)
    ref = reference_logits(int4_checkpoint, w.prompts, 4, replace_experts(deq))
    for r in results:
        for a, b in zip(r.logits, ref):
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (r.policy, (a - b).abs().max().item())


def test_the_packers_follow_the_documented_layouts():
    """By hand on one word: GPTQ packs in-features in order (v1 stores z - 1), AWQ outputs in the
    order 0, 2, 4, 6, 1, 3, 5, 7; both dequantize to (q - z) * s."""
    q = np.arange(8, dtype=np.uint8)
    assert gptq_pack.pack_bits(q[:, None], 4)[0, 0] == 0x76543210
    assert gptq_pack._awq_pack(q[None, :])[0, 0] == 0x75316420
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    t = gptq_pack.gptq_tensors(w, 4, GROUP)
    _, scale, zero = gptq_pack.quantize(w, 4, GROUP)
    stored = gptq_pack.unpack_bits(t["qzeros"].T.copy(), 4, 64).T
    assert np.array_equal(stored, (zero.astype(int) - 1) & 15)
    for sym in (False, True):
        q, scale, zero = gptq_pack.quantize(w, 4, GROUP, sym)
        r = gptq_pack.dequantize(q, scale, zero, GROUP)
        assert np.linalg.norm(r - w) / np.linalg.norm(w) < 0.15
        assert sym is False or (zero == 8).all()


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_desc_act_groups_are_refused_in_one_line(int4_checkpoint, tmp_path):
    from cmoe.core.errors import CmoeError
    from tests.test_executor import run_exec
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))

    def act_order(key, parts):
        parts["g_idx"] = (perm // GROUP).int()             # groups in activation order, as desc_act=True stores them
    write_quantized(int4_checkpoint, tmp_path / "act", "gptq", act_order)
    with pytest.raises(CmoeError) as e:
        run_exec(tmp_path / "act", ["upper"], fmt=None)
    assert "quantized with desc_act (their g_idx reorders the groups)" in _one_line(e)
    assert "use a checkpoint quantized with desc_act=False" in str(e.value)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_gptq_and_awq_need_their_quantization_config(quantized, kind, tmp_path):
    """Without it the zero-point layout (GPTQ: stored minus one or not) is unknown: refused."""
    import shutil

    from cmoe.core.errors import CmoeError
    from tests.test_executor import run_exec
    d = tmp_path / "noconfig"
    shutil.copytree(quantized[kind][0], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CmoeError) as e:
        run_exec(d, ["upper"], fmt=None)
    name = kind.upper()
    assert f"the experts are {name} tensors but config.json has no {kind} quantization_config" in _one_line(e)


def test_another_quant_for_stored_experts_is_refused(quantized):
    from cmoe.core.errors import CmoeError
    from tests.test_executor import run_exec
    with pytest.raises(CmoeError, match="runs as stored: leave out --quant, or pass --quant w4g32-fp16"):
        run_exec(quantized["gptq"][0], ["upper"], fmt="w4g32")


def test_scales_that_do_not_fit_fp16_are_refused(int4_checkpoint, tmp_path):
    from cmoe.core.errors import CmoeError
    from tests.test_executor import run_exec

    def tiny_bf16_scales(key, parts):                  # the same bytes; below fp16's range
        parts["scales"] = parts["scales"].to(torch.bfloat16) * 2 ** -30
    write_quantized(int4_checkpoint, tmp_path / "bf16", "awq", tiny_bf16_scales)
    with pytest.raises(CmoeError) as e:
        run_exec(tmp_path / "bf16", ["upper"], fmt=None)
    assert "the experts' torch.bfloat16 AWQ scales do not fit torch.float16 exactly" in _one_line(e)


def test_torch_cuda_int4_kernel_is_refused_for_fp16_scales():
    """torch's CUDA int4 kernel reads bf16 (scale, zero) pairs only: the loop kernel on CUDA refuses
    a -fp16 store before any memory is taken (checked without a GPU)."""
    from cmoe.core.errors import CmoeError
    from cmoe.core.spec import preset
    from cmoe.executor.store import HostStore
    with pytest.raises(CmoeError, match="run on CUDA only in the one-launch layer kernel"):
        HostStore(preset("mixtral-8x7b"), "w4g128-fp16", torch.device("cuda"), "cuda")


def test_float_experts_into_a_fp16_format_and_random_stores(int4_checkpoint):
    """A -fp16 format is a whole executor format: float experts quantized into it (round to nearest,
    fp16 scale and zero point) run as their dequantized model; random stores fill it."""
    from cmoe.executor.kernels import dequantize, quantize_zp
    from cmoe.executor.store import random_store
    from tests.test_executor import reference_logits, run_exec
    w, results = run_exec(int4_checkpoint, ["upper"], fmt="w4g32-fp16", kernel="fused")

    def requantized(model):
        with torch.no_grad():
            for layer in model.model.layers:
                ex = layer.mlp.experts
                for e in range(ex.gate_up_proj.shape[0]):
                    ex.gate_up_proj[e] = dequantize(*quantize_zp(ex.gate_up_proj[e], GROUP), GROUP)
                    ex.down_proj[e] = dequantize(*quantize_zp(ex.down_proj[e], GROUP), GROUP)
    ref = reference_logits(int4_checkpoint, w.prompts, 4, requantized)
    for a, b in zip(results[0].logits, ref):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (a - b).abs().max().item()
    s = random_store(w.spec, "w4g32-fp16", torch.device("cpu"), seed=3, packing="tiled")
    t = random_store(w.spec, "w4g32-fp16", torch.device("cpu"), seed=3, packing="cpu")
    assert all(torch.equal(a, b) for a, b in zip(store_weights(s, 1, 2), store_weights(t, 1, 2)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_gptq_and_awq_experts_run_as_stored_on_cuda(int4_checkpoint, quantized, kind):
    """The same checkpoints on the GPU: the store's tiled bytes hold the checkpoint's weights bit for
    bit, and the prefill logits (bf16 on the GPU, the Triton layer kernel's ZP branch) match the
    fp32 model with those weights."""
    from tests.test_executor import assert_prefill_matches, run_exec_cuda
    path, deq = quantized[kind]
    w, results = run_exec_cuda(path)
    assert w.fmt == "w4g32-fp16" and w.store.packing == "tiled"
    for m, d in enumerate(w.spec.moe_layers):
        w13, w2 = store_weights(w.store, m, 2)
        want13, want2 = expert_weights(deq, d, 2)
        assert torch.equal(w13, want13) and torch.equal(w2, want2)
    assert_prefill_matches(results, w.prompts, int4_checkpoint, replace_experts(deq))
