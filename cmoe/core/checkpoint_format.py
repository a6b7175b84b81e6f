"""The storage format of a checkpoint's experts, as a cmoe format name (see cmoe.core.quant):
`detect_expert_format` reads it from config.json's `quantization_config` first and the tensors
second, and refuses it unless cmoe.core.quant's sizes of that format are the bytes stored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cmoe.core.checkpoint_experts import _CANON, _FUSED, _PER_EXPERT, _PLAIN, checkpoint_expert_tensors
from cmoe.core.errors import CmoeError
from cmoe.core.quant import expert_tensor_bytes
from cmoe.core.safetensors_header import read_headers
from cmoe.core.spec import ModelSpec


def _cannot_size(model_dir: Path, what: str) -> CmoeError:
    return CmoeError(f"{model_dir}: the experts are stored as {what}, which cmoe cannot size exactly: "
                     f"trace with --quant RECIPE (e.g. w4a16) to size them by a recipe instead")


def _first_w1(model_dir: Path, spec: ModelSpec) -> dict[str, dict]:
    """suffix -> header entry of the first MoE layer's expert 0 gate matrix (fused: its [2F, H] part's)."""
    d = spec.moe_layers[0]
    found: dict[str, dict] = {}
    for _path, header in read_headers(model_dir):
        for name, entry in header.items():
            m = _PER_EXPERT.match(name)
            if m and int(m.group(1)) == d and m.group(2) == "0" and _CANON[m.group(3)] == "w1":
                found[m.group(4)] = entry
            elif (m := _FUSED.match(name)) and int(m.group(1)) == d and m.group(2) == "gate_up_proj":
                found[m.group(3) or "weight"] = dict(entry, shape=entry["shape"][1:])
    return found


def _quantization_config(model_dir: Path) -> dict | None:
    cfg = json.loads((model_dir / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if qc is not None and not isinstance(qc, dict):
        raise CmoeError(f"{model_dir}/config.json has a quantization_config that is not an object: restore its own")
    return qc


def gptq_layout(qc: dict) -> str:
    """GPTQ's tensor layout: "gptq" (the original, zero points stored minus one), "gptq_v2" (as
    they are), or another (e.g. marlin); older configs name none (the original)."""
    return qc.get("checkpoint_format") or qc.get("format") or "gptq"


def _gptq(model_dir: Path, qc: dict) -> str:
    bits, group = qc.get("bits"), qc.get("group_size")
    if gptq_layout(qc) not in ("gptq", "gptq_v2"):
        raise _cannot_size(model_dir, f"GPTQ in the '{gptq_layout(qc)}' layout")
    if not isinstance(bits, int) or not isinstance(group, int) or group <= 0:
        raise _cannot_size(model_dir, f"GPTQ with bits {bits} and group_size {group}")
    return f"gptq-w{bits}g{group}"


def _awq(model_dir: Path, qc: dict) -> str:
    bits, group = qc.get("bits") or qc.get("w_bit"), qc.get("group_size") or qc.get("q_group_size")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or not isinstance(bits, int) or not isinstance(group, int) or group <= 0:
        raise _cannot_size(model_dir, f"AWQ (version {version}, bits {bits}, group_size {group})")
    return f"awq-w{bits}g{group}"


def _compressed_tensors(model_dir: Path, qc: dict) -> str:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    if len({json.dumps([g["weights"], g.get("format")], sort_keys=True) for g in groups}) != 1:
        raise _cannot_size(model_dir, f"compressed-tensors with {len(groups)} different weight schemes")
    w, fmt = groups[0]["weights"], groups[0].get("format") or qc.get("format")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if fmt == "pack-quantized" and kind == "int" and strategy == "group" and w.get("symmetric", True) \
            and isinstance(w.get("group_size"), int):
        return f"ct-w{bits}g{w.get('group_size')}"
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        block = w.get("block_structure") or []
        named = {"tensor": "fp8", "channel": "fp8-ch"}.get(strategy)
        if strategy == "block" and len(block) == 2 and block[0] == block[1]:
            named = f"fp8-b{block[0]}"
        if named:
            return named
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8 and strategy == "channel":
        return "w8a8"
    sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
    raise _cannot_size(model_dir, f"compressed-tensors {fmt} ({kind}{bits}, {strategy}, {sym})")


def _fp8(model_dir: Path, qc: dict) -> str:
    block = qc.get("weight_block_size")
    if not block:
        return "fp8"
    if len(block) != 2 or block[0] != block[1]:
        raise _cannot_size(model_dir, f"fp8 in {block} blocks")
    return f"fp8-b{block[0]}"


def _bitsandbytes(model_dir: Path, qc: dict) -> str:
    if qc.get("load_in_8bit"):
        return "bnb-int8"
    raise _cannot_size(model_dir, f"bitsandbytes {qc.get('bnb_4bit_quant_type', 'fp4')} (each tensor carries "
                                  f"a variable-length quant_state)")


_METHODS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
            "bitsandbytes": _bitsandbytes}


def _from_config(model_dir: Path, qc: dict) -> str:
    method = qc.get("quant_method")
    if method not in _METHODS:
        raise _cannot_size(model_dir, f"quant_method '{method}' (cmoe knows {', '.join(_METHODS)})")
    return _METHODS[method](model_dir, qc)


def _from_tensors(model_dir: Path, w1: dict[str, dict], spec: ModelSpec) -> str:
    f, h = spec.expert_ffn, spec.hidden
    if "qweight" in w1 and "scales" in w1:
        q, sc = w1["qweight"]["shape"], w1["scales"]["shape"]
        group = h // sc[0]
        if q[0] * 32 % h == 0 and q[1] == f:            # GPTQ: [in*b/32, out]
            return f"gptq-w{q[0] * 32 // h}g{group}"
        return f"awq-w{q[1] * 32 // f}g{group}"         # AWQ: [in, out*b/32]
    if "weight_packed" in w1 and "weight_scale" in w1:  # compressed-tensors: [out, in*b/32], [out, in/g]
        return f"ct-w{w1['weight_packed']['shape'][1] * 32 // h}g{h // w1['weight_scale']['shape'][1]}"
    dtype = w1.get("weight", {}).get("dtype")
    if dtype and dtype.startswith("F8_"):
        return _fp8_from_scales(model_dir, w1, f, h)
    if dtype == "I8" and "SCB" in w1:
        return "bnb-int8"
    if dtype == "I8" and "weight_scale" in w1:
        return "w8a8"
    state = next((k.rsplit("__", 1)[1] for k in w1 if k.startswith("weight.quant_state.bitsandbytes__")), None)
    if dtype == "U8" and state:
        raise _cannot_size(model_dir, f"bitsandbytes {state} (each tensor carries a variable-length quant_state)")
    raise CmoeError(f"{model_dir}: cannot tell how the experts of layer {spec.moe_layers[0]} are stored "
                    f"(w1 tensors: {', '.join(sorted(w1))}): add the checkpoint's quantization_config to config.json")


def _fp8_from_scales(model_dir: Path, w1: dict[str, dict], f: int, h: int) -> str:
    if "weight_scale_inv" in w1:                        # [ceil(out/B), ceil(in/B)]
        shape = w1["weight_scale_inv"]["shape"]
        b = next((b for b in (128, 64, 256, 32) if shape == [math.ceil(f / b), math.ceil(h / b)]), None)
        if b is not None:
            return f"fp8-b{b}"
    elif "weight_scale" in w1:
        n = math.prod(w1["weight_scale"]["shape"])
        if n in (1, f):
            return "fp8" if n == 1 else "fp8-ch"
    raise _cannot_size(model_dir, f"fp8 with scales {', '.join(sorted(w1))}")


def detect_expert_format(model_dir: Path, spec: ModelSpec) -> str:
    """The storage format of the first expert, as a cmoe format name (see cmoe.core.quant): plain
    float weights by their dtype, else from quantization_config, else from the tensors; refused
    unless that format's sizes are the first expert's stored bytes."""
    stored = sum(checkpoint_expert_tensors(model_dir, spec)[0][0].values())
    w1 = _first_w1(model_dir, spec)
    if set(w1) == {"weight"} and w1["weight"]["dtype"] in _PLAIN:   # not quantized (or left out of it)
        fmt = _PLAIN[w1["weight"]["dtype"]]
    elif qc := _quantization_config(model_dir):
        fmt = _from_config(model_dir, qc)
    else:
        fmt = _from_tensors(model_dir, w1, spec)
    want = sum(expert_tensor_bytes(spec, fmt).values())
    if stored != want:
        raise CmoeError(f"{model_dir}: expert 0 of layer {spec.moe_layers[0]} stores {stored} bytes but cmoe's "
                        f"{fmt} layout of its shapes takes {want}: cmoe cannot size this format exactly; "
                        f"trace with --quant RECIPE (e.g. w4a16) instead")
    return fmt
