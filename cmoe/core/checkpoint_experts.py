"""The routed experts a checkpoint stores, found by tensor name in its safetensors headers, and
checked against config.json: every routed expert of every MoE layer is stored, no more experts
than config.json says, and plain weights have the shapes config.json implies. Names understood
(layer L, expert E):

- per expert, original checkpoints and what transformers 5 saves:
  `model.layers.L.block_sparse_moe.experts.E.w1.weight` (Mixtral) and
  `model.layers.L.mlp.experts.E.gate_proj.weight` (DeepSeek, Qwen, OLMoE), with any suffix a
  quantizer writes (`qweight`, `qzeros`, `scales`, `g_idx`, `weight_scale`, ...);
- fused, as transformers 5 holds them in memory: `model.layers.L.mlp.experts.gate_up_proj`
  [E, 2F, H] and `down_proj` [E, H, F] (and their quantized companions), split evenly by E.
"""

from __future__ import annotations

import re
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.safetensors_header import read_headers, tensor_nbytes
from cmoe.core.spec import ModelSpec

_PER_EXPERT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(.+)$")
_FUSED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:[._](.+))?$")
_CANON = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}
_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_COMPLETE = ({"w1", "w2", "w3"}, {"gate_up_proj", "down_proj"})


def _mismatch(model_dir: Path, problem: str) -> CmoeError:
    return CmoeError(f"{model_dir}: {problem}: is config.json from this checkpoint?")


def _is_moe_layer(model_dir: Path, name: str, layer: int, spec: ModelSpec) -> bool:
    if layer in spec.moe_layers:
        return True
    if layer >= spec.num_layers:             # extra modules, e.g. DeepSeek-V3's multi-token-prediction layer
        return False
    raise _mismatch(model_dir, f"{name} holds routed experts in decoder layer {layer}, which config.json makes dense")


def _check_shape(model_dir: Path, name: str, entry: dict, suffix: str, want: list[int], spec: ModelSpec) -> None:
    """Plain stored weights have the shape config.json implies (bitsandbytes 4-bit packs them flat)."""
    if suffix == "weight" and entry["dtype"] != "U8" and entry["shape"] != want:
        raise _mismatch(model_dir, f"{name} has shape {entry['shape']} but config.json (hidden_size {spec.hidden}, "
                                   f"expert ffn {spec.expert_ffn}) needs {want}")


def _expert_parts(model_dir: Path, name: str, entry: dict, spec: ModelSpec) -> list[tuple[int, int, str, int]]:
    """(MoE layer index, expert, 'w1.qweight', bytes) for each expert this tensor holds; [] if none."""
    f, h, E = spec.expert_ffn, spec.hidden, spec.num_experts
    if m := _PER_EXPERT.match(name):
        layer, e, w, suffix = int(m.group(1)), int(m.group(2)), _CANON[m.group(3)], m.group(4)
        if not _is_moe_layer(model_dir, name, layer, spec):
            return []
        if e >= E:
            raise _mismatch(model_dir, f"{name} is expert {e} but config.json says {E} experts per MoE layer")
        _check_shape(model_dir, name, entry, suffix, list(spec.expert_shapes()[w]), spec)
        return [(spec.moe_layers.index(layer), e, f"{w}.{suffix}", tensor_nbytes(entry))]
    if m := _FUSED.match(name):
        layer, which, suffix = int(m.group(1)), m.group(2), m.group(3) or "weight"
        if not _is_moe_layer(model_dir, name, layer, spec):
            return []
        n = tensor_nbytes(entry)
        if not entry["shape"] or entry["shape"][0] != E or n % E:
            raise _mismatch(model_dir, f"fused tensor {name} has shape {entry['shape']}, which does not split "
                                       f"into the {E} experts config.json says")
        _check_shape(model_dir, name, entry, suffix, [E, 2 * f, h] if which == "gate_up_proj" else [E, h, f], spec)
        return [(spec.moe_layers.index(layer), e, f"{which}.{suffix}", n // E) for e in range(E)]
    return []


def expert_tensors(model_dir: Path, spec: ModelSpec, headers) -> list[list[dict[str, int]]]:
    """`checkpoint_expert_tensors` from headers already read; refused unless every routed expert
    of every MoE layer is stored whole."""
    out: list[list[dict[str, int]]] = [[{} for _ in range(spec.num_experts)] for _ in spec.moe_layers]
    for _path, header in headers:
        for name, entry in header.items():
            for m, e, key, n in _expert_parts(model_dir, name, entry, spec):
                out[m][e][key] = n
    missing = [(spec.moe_layers[m], e) for m, row in enumerate(out) for e, t in enumerate(row) if not t]
    if missing:
        layer, e = missing[0]
        raise _mismatch(model_dir, f"no tensors found for expert {e} of layer {layer} ({len(missing)} experts missing)")
    for m, row in enumerate(out):
        for e, t in enumerate(row):
            parts = {k.split(".")[0] for k in t}
            if parts not in _COMPLETE:
                raise CmoeError(f"could not load the checkpoint in {model_dir}: expert {e} of layer "
                                f"{spec.moe_layers[m]} stores only {sorted(parts)}: a shard is missing, re-download it")
    return out


def checkpoint_expert_tensors(model_dir: Path, spec: ModelSpec) -> list[list[dict[str, int]]]:
    """Bytes of every stored tensor of every routed expert: [moe_layer][expert] -> {'w1.qweight': n}."""
    return expert_tensors(model_dir, spec, read_headers(model_dir))


def checkpoint_expert_bytes(model_dir: Path, spec: ModelSpec) -> list[list[int]]:
    return [[sum(t.values()) for t in row] for row in checkpoint_expert_tensors(model_dir, spec)]


def first_unplain_expert(model_dir: Path, spec: ModelSpec, headers) -> str | None:
    """The first expert tensor that is not a plain bf16/fp16/fp32 weight; None if all are."""
    for _path, header in headers:
        for name, entry in header.items():
            for _m, _e, key, _n in _expert_parts(model_dir, name, entry, spec)[:1]:
                if key.split(".", 1)[1] != "weight" or entry["dtype"] not in _PLAIN:
                    return name
    return None
