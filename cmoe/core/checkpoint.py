"""A local checkpoint, read and checked from its config.json and safetensors headers, without
loading any weight; and exact expert sizes from those headers.

`check_checkpoint` is the boundary every command that reads a checkpoint (trace, execute,
quality, calibrate, run) crosses before any weight moves: config.json is an object with the
fields its family needs; every safetensors file's header parses and its tensors tile the bytes
that follow it exactly (a truncated download or flipped bytes show here, as they would when
safetensors loads the file); every routed expert of every MoE layer is stored, no more experts
than config.json says, and plain weights have the shapes config.json implies.

A safetensors file opens with an 8-byte little-endian header length and a JSON header that gives
each tensor's dtype, shape and byte range, so the bytes of every expert tensor are known from a
few kilobytes of reading. Names understood (layer L, expert E):

- per expert, original checkpoints and what transformers 5 saves:
  `model.layers.L.block_sparse_moe.experts.E.w1.weight` (Mixtral) and
  `model.layers.L.mlp.experts.E.gate_proj.weight` (DeepSeek, Qwen, OLMoE), with any suffix a
  quantizer writes (`qweight`, `qzeros`, `scales`, `g_idx`, `weight_scale`, ...);
- fused, as transformers 5 holds them in memory: `model.layers.L.mlp.experts.gate_up_proj`
  [E, 2F, H] and `down_proj` [E, H, F] (and their quantized companions), split evenly by E.

The storage format (`detect_expert_format`) comes from config.json's `quantization_config`
first and the tensors second, and is refused unless cmoe.core.quant's sizes of that format are the
bytes stored.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.quant import expert_tensor_bytes
from cmoe.core.spec import ModelSpec, from_checkpoint

_PER_EXPERT = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(.+)$")
_FUSED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:[._](.+))?$")
_CANON = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}
_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
               "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "U16": 16, "U32": 32, "U64": 64,
               "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_COMPLETE = ({"w1", "w2", "w3"}, {"gate_up_proj", "down_proj"})
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
MAX_HEADER = 100_000_000                               # what safetensors itself accepts
INDEX = "model.safetensors.index.json"


def _unreadable(path: Path, problem: str, fix: str = "re-download it") -> CmoeError:
    return CmoeError(f"could not load the checkpoint in {path.parent}: {path.name} {problem}: {fix}")


def _mismatch(model_dir: Path, problem: str) -> CmoeError:
    return CmoeError(f"{model_dir}: {problem}: is config.json from this checkpoint?")


# --- safetensors files and headers -------------------------------------------------------------

def read_header(path: Path) -> dict:
    """The JSON header of one .safetensors file (tensor name -> dtype, shape, data_offsets),
    checked against the file as safetensors checks it when loading."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _unreadable(path, "is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise _unreadable(path, f"has a corrupted header (its length field says {n} bytes, more than "
                                    f"safetensors allows)")
        if n > size - 8:
            raise _unreadable(path, f"has a corrupted header (its length field says {n} bytes, "
                                    f"the file holds {size - 8} after it)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _unreadable(path, "has a corrupted header (not valid JSON)", "re-download or re-save it") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "has a corrupted header (not a JSON object)")
    header.pop("__metadata__", None)
    _check_ranges(path, header, size - 8 - n)
    return header


def _naturals(xs) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)


def _entry_ok(e) -> bool:
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str):
        return False
    shape, offs = e.get("shape"), e.get("data_offsets")
    return _naturals(shape) and _naturals(offs) and len(offs) == 2 and offs[0] <= offs[1]


def _check_ranges(path: Path, header: dict, data_bytes: int) -> None:
    """Each tensor's byte range fits its dtype and shape; the ranges tile the data exactly."""
    spans = []
    for name, e in header.items():
        if not _entry_ok(e):
            raise _unreadable(path, f"has a corrupted header (entry {name} lacks a valid dtype, shape or data_offsets)")
        bits = _DTYPE_BITS.get(e["dtype"])
        if bits is None:
            raise _unreadable(path, f"stores {name} as {e['dtype']}, a dtype this cmoe does not know",
                              "convert it to a standard dtype")
        start, end = e["data_offsets"]
        if end - start != math.ceil(math.prod(e["shape"]) * bits / 8):
            raise _unreadable(path, f"has a corrupted header ({name}: {end - start} bytes for shape "
                                    f"{e['shape']} of {e['dtype']})")
        spans.append((start, end, name))
    pos = 0
    for start, end, name in sorted(spans):
        if start != pos:
            raise _unreadable(path, f"has a corrupted header (tensor {name} starts at byte {start}, not {pos})")
        pos = end
    if pos > data_bytes:
        raise _unreadable(path, f"is truncated (its tensors need {pos} bytes of data, the file holds {data_bytes})",
                          "the download was cut short, re-download it")
    if pos < data_bytes:
        raise _unreadable(path, f"has {data_bytes - pos} stray bytes after its last tensor")


def tensor_nbytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


def safetensors_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files: those the shard index names, else every *.safetensors; [] for pickle
    weights when they are allowed."""
    if (model_dir / INDEX).is_file():
        return _indexed_files(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles and not allow_pickle:
        raise CmoeError(f"{model_dir} holds only pickle weights ({pickles[0].name}); pickle files can run "
                        f"code when loaded: convert to safetensors, or pass --allow-pickle if you trust them")
    if not pickles:
        raise CmoeError(f"{model_dir} has no weight files (*.safetensors)")
    return []


def _weight_map(model_dir: Path) -> dict[str, str]:
    path = model_dir / INDEX
    try:
        wm = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        wm = None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise _unreadable(path, "is not a shard index (no weight_map of tensor -> file)", "re-download it")
    return wm


def _indexed_files(model_dir: Path) -> list[Path]:
    files = sorted(set(_weight_map(model_dir).values()))
    absent = [f for f in files if not (model_dir / f).is_file()]
    if absent:
        raise CmoeError(f"could not load the checkpoint in {model_dir}: {INDEX} names {absent[0]}, which is "
                        f"missing ({len(absent)} of {len(files)} shards): the download is incomplete, fetch the rest")
    return [model_dir / f for f in files]


def _headers(model_dir: Path) -> list[tuple[Path, dict]]:
    return [(p, read_header(p)) for p in safetensors_files(model_dir)]


def _check_index(model_dir: Path, headers: list[tuple[Path, dict]]) -> None:
    """Every tensor the shard index names is in the shard it names."""
    if not (model_dir / INDEX).is_file():
        return
    held = {p.name: h for p, h in headers}
    for name, file in _weight_map(model_dir).items():
        if name not in held[file]:
            raise _unreadable(model_dir / file, f"lacks {name}, which {INDEX} puts there")


# --- experts -----------------------------------------------------------------------------------

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


def _expert_tensors(model_dir: Path, spec: ModelSpec, headers) -> list[list[dict[str, int]]]:
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
    return _expert_tensors(model_dir, spec, _headers(model_dir))


def checkpoint_expert_bytes(model_dir: Path, spec: ModelSpec) -> list[list[int]]:
    return [[sum(t.values()) for t in row] for row in checkpoint_expert_tensors(model_dir, spec)]


def check_checkpoint(model_dir: str | Path, allow_pickle: bool = False, float_experts: bool = False) -> ModelSpec:
    """The model spec of a local checkpoint, once config.json, the safetensors files and the
    stored experts agree (see the module docstring); one CmoeError line otherwise. Pickle weights
    (allowed) cannot be read without unpickling: only config.json is checked then.
    `float_experts`: also require plain bf16/fp16/fp32 expert weights (what the executor reads)."""
    model_dir = Path(model_dir)
    spec = from_checkpoint(model_dir)
    if not safetensors_files(model_dir, allow_pickle):
        return spec
    headers = _headers(model_dir)
    _check_index(model_dir, headers)
    _expert_tensors(model_dir, spec, headers)
    if float_experts and (name := _first_unplain_expert(model_dir, spec, headers)):
        fmt = detect_expert_format(model_dir, spec)
        if not EXECUTABLE_PACKED.match(fmt):
            raise CmoeError(f"{model_dir}: expert tensor {name} is stored as {fmt}: the executor runs float expert "
                            f"weights and compressed-tensors W4A16 (pack-quantized, symmetric, groups of 32-256) "
                            f"as stored; trace this checkpoint (cmoe trace) to simulate it instead")
    return spec


EXECUTABLE_PACKED = re.compile(r"^ct-w4g(32|64|128|256)$")      # quantized experts the executor runs as stored


def executor_format(model_dir: str | Path, spec: ModelSpec) -> str | None:
    """The executor format a checkpoint's experts already are (w4gG for compressed-tensors W4A16),
    or None for float experts, which the executor quantizes itself."""
    model_dir = Path(model_dir)
    if not _first_unplain_expert(model_dir, spec, _headers(model_dir)):
        return None
    fmt = detect_expert_format(model_dir, spec)
    return "w4g" + fmt.rsplit("g", 1)[1] if EXECUTABLE_PACKED.match(fmt) else None


def _first_unplain_expert(model_dir: Path, spec: ModelSpec, headers) -> str | None:
    for _path, header in headers:
        for name, entry in header.items():
            for _m, _e, key, _n in _expert_parts(model_dir, name, entry, spec)[:1]:
                if key.split(".", 1)[1] != "weight" or entry["dtype"] not in _PLAIN:
                    return name
    return None


# --- storage format ----------------------------------------------------------------------------

def _cannot_size(model_dir: Path, what: str) -> CmoeError:
    return CmoeError(f"{model_dir}: the experts are stored as {what}, which cmoe cannot size exactly: "
                     f"trace with --quant RECIPE (e.g. w4a16) to size them by a recipe instead")


def _first_w1(model_dir: Path, spec: ModelSpec) -> dict[str, dict]:
    """suffix -> header entry of the first MoE layer's expert 0 gate matrix (fused: its [2F, H] part's)."""
    d = spec.moe_layers[0]
    found: dict[str, dict] = {}
    for _path, header in _headers(model_dir):
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


def _gptq(model_dir: Path, qc: dict) -> str:
    bits, group = qc.get("bits"), qc.get("group_size")
    if qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise _cannot_size(model_dir, f"GPTQ in the '{qc['checkpoint_format']}' layout")
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
