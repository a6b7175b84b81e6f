"""GPTQ and AWQ checkpoints made by GPTQModel itself on the CPU (experts only, 4 bits, groups of
32), executed as stored: the store's weights equal the library's own dequantization of the saved
tensors bit for bit, and the logits equal the fp32 model with those weights.

Skipped unless gptqmodel is importable. It is not a project dependency (GPTQModel 7.7.0 pins
torch>=2.14.1 and transformers>=5.20.2, yet quantizes fine on this project's torch 2.13 and
transformers 5.17); a throwaway venv that sees the project's packages runs it:

    python3 -m venv /tmp/gq
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/gq/lib/python3.11/site-packages/main.pth
    /tmp/gq/bin/pip install --no-deps gptqmodel==7.7.0
    /tmp/gq/bin/pip install -c <(printf 'torch==2.13.0\\ntransformers==5.17.0\\nnumpy==2.4.6\\n') \\
        pypcre logbar tokenicer device-smi defuser threadpoolctl accelerate dill torchao pillow
    /tmp/gq/bin/python -m pytest tests/test_gptq_library.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GROUP = 32
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                                                   reason="needs gptqmodel (see the module docstring)")]


@pytest.fixture(scope="module")
def source(int4_checkpoint, tmp_path_factory):
    """int4_checkpoint plus a word-level tokenizer (GPTQModel loads one)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("gq") / "src"
    shutil.copytree(int4_checkpoint, d)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2",
                            bos_token="t3").save_pretrained(d)
    return d


def make(src: str, dst: str, method: str) -> None:
    """In a child process (importing gptqmodel patches transformers' MoE modules for good): quantize
    src into dst, and save the library's dequantized expert weights beside it."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")       # its default pool needs more cores than 2
    _quantize(Path(src), Path(dst), method)
    torch.save(_library_weights(Path(dst), method), Path(dst) / "library_weights.pt")


def _quantize(src, dst, method: str):
    from gptqmodel import GPTQModel, QuantizeConfig
    kw = dict(bits=4, group_size=GROUP, sym=False, dynamic={r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {}})
    qc = QuantizeConfig(method="awq", format="gemm", **kw) if method == "awq" else QuantizeConfig(desc_act=False, **kw)
    model = GPTQModel.load(str(src), qc, device="cpu")
    g = torch.Generator().manual_seed(0)
    model.quantize([{"input_ids": torch.randint(0, 64, (1, 32), generator=g),
                     "attention_mask": torch.ones(1, 32, dtype=torch.long)} for _ in range(8)], batch_size=1)
    model.save(str(dst))
    return dst


def _library_weights(path, method: str) -> dict[str, torch.Tensor]:
    """'layer.expert.proj' -> the library's dequantization [out, in] of the saved tensors, in fp32
    (scales as fp32, so that its (q - z) * s is exact)."""
    from safetensors.torch import load_file
    sd = load_file(str(path / "model.safetensors"))
    out = {}
    if method == "awq":
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
        for k in sd:
            if k.endswith(".qweight"):
                p = k[: -len(".qweight")]
                w = dequantize_gemm(sd[k], sd[f"{p}.qzeros"], sd[f"{p}.scales"].float(), 4, GROUP)
                out[_key(p)] = w.T.contiguous()
        return out
    from gptqmodel import BACKEND, GPTQModel
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.GPTQ_TORCH)   # v1 zeros -> v2 on load
    for name, mod in model.model.named_modules():
        if ".experts." in name and hasattr(mod, "dequantize_weight"):
            mod.scales = sd[f"{name}.scales"].float()
            out[_key(name)] = mod.dequantize_weight().T.contiguous()
    return out


def _key(name: str) -> str:
    parts = name.split(".")                  # model.layers.L.mlp.experts.E.proj
    return f"{parts[2]}.{parts[5]}.{parts[6]}"


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_library_made_checkpoint_runs_as_stored(source, tmp_path, method):
    from safetensors.torch import load_file

    from tests.test_executor import reference_logits, run_exec
    from tests.test_gptq_checkpoint import expert_weights, replace_experts, store_weights
    path = tmp_path / method
    code = f"from tests.test_gptq_library import make; make({str(source)!r}, {str(path)!r}, {method!r})"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,     # its logs/ lands there
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lib = torch.load(path / "library_weights.pt")
    assert len(lib) == 3 * 4 * 3
    for kernel in ("loop", "fused"):
        w, results = run_exec(path, ["upper", "ondemand", "static"], fmt=None, kernel=kernel)
        assert w.fmt == "w4g32-fp16"
        for m, d in enumerate(w.spec.moe_layers):
            for e in range(w.spec.num_experts):
                w13, w2 = store_weights(w.store, m, e)
                want13, want2 = expert_weights(lib, d, e)
                assert torch.equal(w13, want13) and torch.equal(w2, want2), (kernel, m, e)
        others = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
                  if ".experts." not in k}          # GPTQModel saved them in bf16

        def apply(model):
            missing, unexpected = model.load_state_dict(others, strict=False)
            assert not unexpected
            replace_experts(lib)(model)
        ref = reference_logits(source, w.prompts, 4, apply)
        for r in results:
            for a, b in zip(r.logits, ref):
                assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (kernel, r.policy, (a - b).abs().max().item())
