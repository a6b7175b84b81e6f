"""Bad checkpoints at the boundary: every command that reads a checkpoint (trace, execute, quality,
calibrate) refuses a corrupt or inconsistent one in one line, before any weight moves; and the
storage format of quantized experts is read from quantization_config first, the tensors second,
or refused when cmoe cannot size it exactly."""

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from cmoe.core.checkpoint import check_checkpoint, detect_expert_format  # noqa: E402
from cmoe.cli.app import app  # noqa: E402
from cmoe.core.errors import CmoeError  # noqa: E402
from cmoe.core.spec import from_checkpoint  # noqa: E402
from tests.conftest import FAMILIES  # noqa: E402

runner = CliRunner()
ST = "model.safetensors"


def _clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _keep_tensors(d: Path, keep) -> None:
    from safetensors.numpy import load_file, save_file
    save_file({k: v for k, v in load_file(str(d / ST)).items() if keep(k)}, str(d / ST))


def _gptq(d: Path, quantization_config: dict | None) -> None:
    """Experts as GPTQ tensors (4 bits, groups of 16), with or without their quantization_config."""
    from safetensors.numpy import load_file, save_file

    from cmoe.core.checkpoint import _PER_EXPERT
    from tests.gptq_pack import gptq_tensors
    out = {}
    for name, w in load_file(str(d / ST)).items():
        if not _PER_EXPERT.match(name):
            out[name] = w
            continue
        out.update({f"{name[:-len('.weight')]}.{k}": v for k, v in gptq_tensors(w, 4, 16).items()})
    save_file(out, str(d / ST))
    if quantization_config:
        _edit_config(d, quantization_config=quantization_config)


def _truncate(d: Path) -> None:
    data = (d / ST).read_bytes()
    (d / ST).write_bytes(data[:-1000])


def _flip(d: Path, at: int) -> None:
    data = bytearray((d / ST).read_bytes())
    data[at] ^= 0xFF
    (d / ST).write_bytes(bytes(data))


def _missing_shard(d: Path) -> None:
    (d / ST).rename(d / "model-00001-of-00002.safetensors")
    from cmoe.core.checkpoint import read_header
    names = list(read_header(d / "model-00001-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True}

# case -> (base family, how to break it, message fragment, fragment where the tracer's differs)
CASES = {
    "truncated": ("mixtral", _truncate, "model.safetensors is truncated (its tensors need", None),
    "flipped header": ("mixtral", lambda d: _flip(d, 20), "model.safetensors has a corrupted header (not valid JSON)", None),
    "flipped length": ("mixtral", lambda d: _flip(d, 3), "model.safetensors has a corrupted header (its length field says", None),
    "missing shard": ("mixtral", _missing_shard, "names model-00002-of-00002.safetensors, which is missing", None),
    "config is a list": ("mixtral", lambda d: (d / "config.json").write_text("[1, 2]"),
                         "config.json holds a JSON list, not an object", None),
    "config lacks layers": ("mixtral", lambda d: _edit_config(d, num_hidden_layers=None),
                            "config.json lacks 'num_hidden_layers'", None),
    "8 experts, 6 stored": ("olmoe", lambda d: _keep_tensors(d, lambda k: ".experts.6." not in k and ".experts.7." not in k),
                            "no tensors found for expert 6 of layer 0 (6 experts missing)", None),
    "3 experts, 4 stored": ("mixtral", lambda d: _edit_config(d, num_local_experts=3),
                            "experts.3.w1.weight is expert 3 but config.json says 3 experts per MoE layer", None),
    "expert ffn mismatch": ("mixtral", lambda d: _edit_config(d, intermediate_size=40),
                            "experts.0.w1.weight has shape [48, 32] but config.json (hidden_size 32, expert ffn 40) needs [40, 32]", None),
    "gptq without its config": ("mixtral", lambda d: _gptq(d, None),
                                "experts.0.w1.g_idx is stored as gptq-w4g16: the executor runs float expert weights, and 4-bit "
                                "experts in groups of 32-256 as stored",
                                "transformers found 6 of the model's weights nowhere in it (first: model.layers.0."
                                "mlp.experts.down_proj), so they would keep random values; the checkpoint stores "
                                "quantized tensors (e.g. model.layers.0.mlp.experts.0.w1.g_idx) but config.json does "
                                "not say how to read them: restore its quantization_config"),
}


@pytest.fixture(scope="module")
def broken(checkpoints, tmp_path_factory):
    """Each case's broken variant of a tiny checkpoint of the session (built once per module)."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for i, (case, (family, breaker, _, _)) in enumerate(CASES.items()):
        out[case] = _clone(checkpoints[family], root / f"case{i}")
        breaker(out[case])
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("def fibonacci(n):\n")
    return p


def _cli(command: str, model: Path, prompts: Path, out: Path) -> list[str]:
    args = {"trace": ["trace", "--model", model, "--data", prompts, "--out", out, "--device", "cpu",
                      "--tokens", 1],
            "execute": ["execute", "--model", model, "--device", "cpu", "--tokens", 4, "--quant", "fp32"],
            "quality": ["quality", "--model", model, "--tokens", 4, "--device", "cpu"],
            "calibrate": ["calibrate", "--model", model, "--device", "cpu", "--quant", "fp32", "--out", out / "p.json"]}
    return [str(a) for a in args[command]]


def _one_line_error(r, fragment: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = r.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("command", ["trace", "execute", "quality", "calibrate"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_one_line_before_any_weight_moves(case, command, broken, prompts_file, tmp_path):
    _, _, fragment, trace_fragment = CASES[case]
    r = runner.invoke(app, _cli(command, broken[case], prompts_file, tmp_path / "out"))
    _one_line_error(r, trace_fragment if command == "trace" and trace_fragment else fragment)
    assert not (tmp_path / "out").exists()


def test_gptq_needs_optimum_says_what_to_install(checkpoints, prompts_file, tmp_path):
    """transformers' ImportError (122 lines of traceback before) as one line naming the package."""
    import importlib.util
    if importlib.util.find_spec("optimum") is not None:
        pytest.skip("optimum is installed here")
    d = _clone(checkpoints["mixtral"], tmp_path / "gptq")
    _gptq(d, GPTQ_CONFIG)
    r = runner.invoke(app, _cli("trace", d, prompts_file, tmp_path / "out"))
    _one_line_error(r, "needs a package that is not installed (Loading a GPTQ quantized model requires optimum")
    assert r.output.rstrip().endswith("pip install optimum, then run again")


def test_missing_python_module_names_the_pip_package():
    from cmoe.trace.hf import loading_error
    e = ModuleNotFoundError("No module named 'google.protobuf'", name="google.protobuf")
    assert str(loading_error(Path("/m"), "tokenizer", e)) == (
        "loading the tokenizer in /m needs the Python package 'protobuf', which is not installed: pip install protobuf")


@pytest.mark.parametrize("family", FAMILIES)
def test_good_checkpoints_of_every_family_pass_and_their_mismatches_do_not(family, checkpoints, tmp_path):
    spec = check_checkpoint(checkpoints[family], float_experts=True)
    assert spec == from_checkpoint(checkpoints[family])
    count = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}
    ffn = {"mixtral": "intermediate_size", "olmoe": "intermediate_size"}
    d = _clone(checkpoints[family], tmp_path / "more")
    _edit_config(d, **{count.get(family, "num_experts"): spec.num_experts + 2})
    with pytest.raises(CmoeError, match=f"no tensors found for expert {spec.num_experts} of layer {spec.moe_layers[0]}"):
        check_checkpoint(d)
    d = _clone(checkpoints[family], tmp_path / "ffn")
    _edit_config(d, **{ffn.get(family, "moe_intermediate_size"): spec.expert_ffn + 8})
    with pytest.raises(CmoeError, match=rf"experts\.0\.\w+\.weight has shape \[\d+, \d+\] but config.json "
                                        rf"\(hidden_size {spec.hidden}, expert ffn {spec.expert_ffn + 8}\) needs"):
        check_checkpoint(d)


# --- storage format: quantization_config first, tensors second, or refused ------------------------

F, H, G = 48, 32, 16          # the tiny Mixtral's expert matrices: w1, w3 [F, H], w2 [H, F]; groups of 16


def _t(shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def fp8_block(o, i):
    return {"weight": _t((o, i), torch.float8_e4m3fn), "weight_scale_inv": _t((-(-o // G), -(-i // G)))}


def fp8_channel(o, i, scale_dtype=torch.float32):
    return {"weight": _t((o, i), torch.float8_e4m3fn), "weight_scale": _t((o, 1), scale_dtype)}


def fp8_tensor(o, i):
    return {"weight": _t((o, i), torch.float8_e4m3fn), "weight_scale": _t((1,))}


def ct_w4(o, i):
    return {"weight_packed": _t((o, i // 8), torch.int32), "weight_scale": _t((o, i // G), torch.bfloat16),
            "weight_shape": torch.tensor([o, i])}


def gptq_w4(o, i):
    return {"qweight": _t((i // 8, o), torch.int32), "qzeros": _t((i // G, o // 8), torch.int32),
            "scales": _t((i // G, o), torch.float16), "g_idx": _t((i,), torch.int32)}


def awq_w4(o, i):
    return {"qweight": _t((i, o // 8), torch.int32), "qzeros": _t((i // G, o // 8), torch.int32),
            "scales": _t((i // G, o), torch.float16)}


def bnb_nf4(o, i):
    return {"weight": _t((o * i // 2, 1), torch.uint8), "weight.absmax": _t((o * i // 64,)),
            "weight.quant_map": _t((16,)), "weight.quant_state.bitsandbytes__nf4": _t((90,), torch.uint8)}


def bnb_int8(o, i):
    return {"weight": _t((o, i), torch.int8), "SCB": _t((o,))}


def plain(o, i):
    return {"weight": _t((o, i))}


CT_FP8_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}
CT_W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": G,
                                       "symmetric": True}}}}

# case -> (expert tensors of one (out x in) matrix, quantization_config or None, format or refusal fragment)
FORMATS = {
    "fp8 blocks (config)": (fp8_block, {"quant_method": "fp8", "weight_block_size": [G, G]}, "fp8-b16"),
    "fp8 per channel (compressed-tensors)": (fp8_channel, CT_FP8_CHANNEL, "fp8-ch"),
    "fp8 per tensor (tensors only)": (fp8_tensor, None, "fp8"),
    "compressed-tensors w4 (config)": (ct_w4, CT_W4, "ct-w4g16"),
    "compressed-tensors w4 (tensors only)": (ct_w4, None, "ct-w4g16"),
    "gptq (config)": (gptq_w4, GPTQ_CONFIG, "gptq-w4g16"),
    "gptq v2 (config)": (gptq_w4, dict(GPTQ_CONFIG, checkpoint_format="gptq_v2"), "gptq-w4g16"),
    "gptq (tensors only)": (gptq_w4, None, "gptq-w4g16"),
    "gptq marlin (config)": (gptq_w4, dict(GPTQ_CONFIG, checkpoint_format="marlin"),
                             "error: stored as GPTQ in the 'marlin' layout"),
    "awq (config)": (awq_w4, {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm"}, "awq-w4g16"),
    "bitsandbytes int8 (config)": (bnb_int8, {"quant_method": "bitsandbytes", "load_in_8bit": True}, "bnb-int8"),
    "experts left out of quantization": (plain, CT_W4, "fp32"),
    "bitsandbytes nf4 (config)": (bnb_nf4, {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                            "bnb_4bit_quant_type": "nf4"}, "error: stored as bitsandbytes nf4"),
    "bitsandbytes nf4 (tensors only)": (bnb_nf4, None, "error: stored as bitsandbytes nf4"),
    "unknown method": (bnb_int8, {"quant_method": "hqq"}, "error: stored as quant_method 'hqq'"),
    "fp8 with 16-bit scales": (lambda o, i: fp8_channel(o, i, torch.bfloat16), CT_FP8_CHANNEL,
                               "error: stores 4864 bytes but cmoe's fp8-ch layout of its shapes takes 5120"),
}


def _with_experts(src: Path, d: Path, tensors, qc: dict | None) -> Path:
    """src with every expert matrix replaced by `tensors(out, in)` (zeros of the right shapes)."""
    from safetensors.torch import load_file, save_file

    from cmoe.core.checkpoint import _PER_EXPERT
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    out = {}
    for name, w in load_file(str(src / ST)).items():
        if not _PER_EXPERT.match(name):
            out[name] = w
            continue
        out.update({f"{name[:-len('.weight')]}.{k}": v for k, v in tensors(*w.shape).items()})
    save_file(out, str(d / ST))
    if qc:
        _edit_config(d, quantization_config=qc)
    return d


@pytest.mark.parametrize("case", list(FORMATS))
def test_expert_format_from_quantization_config_then_tensors(case, checkpoints, tmp_path):
    tensors, qc, want = FORMATS[case]
    d = _with_experts(checkpoints["mixtral"], tmp_path / "q", tensors, qc)
    spec = check_checkpoint(d)
    if not want.startswith("error: "):
        assert detect_expert_format(d, spec) == want
        return
    with pytest.raises(CmoeError) as e:
        detect_expert_format(d, spec)
    assert want[len("error: "):] in str(e.value) and "\n" not in str(e.value)


def test_trace_refuses_a_format_it_cannot_size(checkpoints, prompts_file, tmp_path):
    d = _with_experts(checkpoints["mixtral"], tmp_path / "nf4", bnb_nf4, None)
    r = runner.invoke(app, _cli("trace", d, prompts_file, tmp_path / "out") + ["--quant", "checkpoint"])
    _one_line_error(r, "the experts are stored as bitsandbytes nf4 (each tensor carries a variable-length "
                       "quant_state), which cmoe cannot size exactly: trace with --quant RECIPE")


def test_fp8_sizes_by_hand():
    """The checkpoint formats' bytes for one 48 x 32 matrix, as stored above."""
    from cmoe.core.quant import format_bits, tensor_bytes
    assert tensor_bytes("fp8-b16", F, H) == {"weight": F * H, "weight_scale_inv": 3 * 2 * 4}
    assert tensor_bytes("fp8-ch", F, H) == {"weight": F * H, "weight_scale": F * 4}
    assert tensor_bytes("ct-w4g16", F, H) == {"weight_packed": F * H // 2, "weight_scale": F * 2 * 2, "weight_shape": 16}
    assert tensor_bytes("bnb-int8", F, H) == {"weight": F * H, "SCB": F * 4}
    assert [format_bits(f) for f in ("fp8", "fp8-ch", "fp8-b128", "ct-w4g128", "bnb-int8")] == [8, 8, 8, 4, 8]
    # one expert (w1, w3: 48 x 32, w2: 32 x 48) in fp8-ch: 5120 bytes; with 16-bit scales it would be 4864
    assert 2 * sum(tensor_bytes("fp8-ch", F, H).values()) + sum(tensor_bytes("fp8-ch", H, F).values()) == 5120
