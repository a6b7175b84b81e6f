"""Safetensors files and their headers, read and checked without loading any weight.

A safetensors file opens with an 8-byte little-endian header length and a JSON header that gives
each tensor's dtype, shape and byte range, so the bytes of every tensor are known from a few
kilobytes of reading. `read_header` checks a header as safetensors checks it when loading: it
parses, and its tensors tile the bytes that follow it exactly (a truncated download or flipped
bytes show here). `safetensors_files` finds a checkpoint's weight files (through its shard index,
if it has one), refusing pickle weights unless they are allowed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from cmoe.core.errors import CmoeError

_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
               "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "U16": 16, "U32": 32, "U64": 64,
               "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
MAX_HEADER = 100_000_000                               # what safetensors itself accepts
INDEX = "model.safetensors.index.json"


def _unreadable(path: Path, problem: str, fix: str = "re-download it") -> CmoeError:
    return CmoeError(f"could not load the checkpoint in {path.parent}: {path.name} {problem}: {fix}")


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


def read_headers(model_dir: Path) -> list[tuple[Path, dict]]:
    """(file, checked header) of every weight file."""
    return [(p, read_header(p)) for p in safetensors_files(model_dir)]


def check_index(model_dir: Path, headers: list[tuple[Path, dict]]) -> None:
    """Every tensor the shard index names is in the shard it names."""
    if not (model_dir / INDEX).is_file():
        return
    held = {p.name: h for p, h in headers}
    for name, file in _weight_map(model_dir).items():
        if name not in held[file]:
            raise _unreadable(model_dir / file, f"lacks {name}, which {INDEX} puts there")
