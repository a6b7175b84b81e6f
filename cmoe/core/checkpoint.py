"""A local checkpoint, read and checked from its config.json and safetensors headers, without
loading any weight; and exact expert sizes from those headers.

`check_checkpoint` is the boundary every command that reads a checkpoint (trace, execute,
quality, calibrate, run) crosses before any weight moves: config.json is an object with the
fields its family needs; every safetensors file's header parses and its tensors tile the bytes
that follow it exactly (`cmoe.core.safetensors_header`); every routed expert of every MoE layer is
stored, no more experts than config.json says, and plain weights have the shapes config.json
implies (`cmoe.core.checkpoint_experts`, which also gives the names understood).

The storage format (`detect_expert_format`, `cmoe.core.checkpoint_format`) comes from
config.json's `quantization_config` first and the tensors second, and is refused unless
cmoe.core.quant's sizes of that format are the bytes stored. The names of those modules are
re-exported here: callers import them from `cmoe.core.checkpoint`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cmoe.core.checkpoint_experts import (_CANON, _FUSED, _PER_EXPERT, checkpoint_expert_bytes,
                                          checkpoint_expert_tensors, expert_tensors, first_unplain_expert)
from cmoe.core.checkpoint_format import _quantization_config, detect_expert_format, gptq_layout
from cmoe.core.errors import CmoeError
from cmoe.core.safetensors_header import (INDEX, MAX_HEADER, PICKLE_SUFFIXES, check_index, read_header,
                                          read_headers, safetensors_files, tensor_nbytes)
from cmoe.core.spec import ModelSpec, from_checkpoint

__all__ = ["EXECUTABLE_PACKED", "INDEX", "MAX_HEADER", "PICKLE_SUFFIXES", "PackedExperts", "check_checkpoint",
           "checkpoint_expert_bytes", "checkpoint_expert_tensors", "detect_expert_format", "executor_format",
           "packed_experts", "read_header", "safetensors_files", "tensor_nbytes",
           "_CANON", "_FUSED", "_PER_EXPERT"]      # the weight store (cmoe.executor.store) parses names with these


def check_checkpoint(model_dir: str | Path, allow_pickle: bool = False, float_experts: bool = False) -> ModelSpec:
    """The model spec of a local checkpoint, once config.json, the safetensors files and the
    stored experts agree (see the module docstring); one CmoeError line otherwise. Pickle weights
    (allowed) cannot be read without unpickling: only config.json is checked then.
    `float_experts`: also require plain bf16/fp16/fp32 expert weights (what the executor reads)."""
    model_dir = Path(model_dir)
    spec = from_checkpoint(model_dir)
    if not safetensors_files(model_dir, allow_pickle):
        return spec
    headers = read_headers(model_dir)
    check_index(model_dir, headers)
    expert_tensors(model_dir, spec, headers)
    if float_experts and (name := first_unplain_expert(model_dir, spec, headers)):
        fmt = detect_expert_format(model_dir, spec)
        if not EXECUTABLE_PACKED.match(fmt):
            raise CmoeError(f"{model_dir}: expert tensor {name} is stored as {fmt}: the executor runs float expert "
                            f"weights, and 4-bit experts in groups of 32-256 as stored: compressed-tensors "
                            f"(pack-quantized, symmetric), GPTQ and AWQ (gemm); trace this checkpoint "
                            f"(cmoe trace) to simulate it instead")
    return spec


# quantized experts the executor runs as stored
EXECUTABLE_PACKED = re.compile(r"^(ct|gptq|awq)-w4g(32|64|128|256)$")


@dataclass(frozen=True)
class PackedExperts:
    """How a checkpoint's 4-bit experts are stored, and the executor format that holds them."""
    stored: str                  # cmoe.core.quant's name: ct-w4g128, gptq-w4g128, awq-w4g128
    fmt: str                     # w4g128 (bf16 scales) or w4g128-fp16 (fp16 scales and zero points)
    zeros_minus_one: bool        # GPTQ's original layout stores each zero point minus one

    @property
    def style(self) -> str:
        return self.stored.split("-", 1)[0]

    @property
    def group(self) -> int:
        return int(self.stored.rsplit("g", 1)[1])

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors each matrix stores (suffixes), as cmoe.core.quant sizes them."""
        from cmoe.core.quant import tensor_bytes
        return tuple(tensor_bytes(self.stored, 64, 256))


def packed_experts(model_dir: str | Path, spec: ModelSpec) -> PackedExperts | None:
    """The checkpoint's quantized experts if the executor runs them as stored, else None (float
    experts, or a format `check_checkpoint(float_experts=True)` refuses). GPTQ needs its
    quantization_config (the zero-point convention is only written there); compressed-tensors
    with fp16 scales goes to a -fp16 format (its zero point is 8), with bf16 or fp32 to w4gG."""
    from cmoe.core.checkpoint_format import _first_w1
    model_dir = Path(model_dir)
    if not first_unplain_expert(model_dir, spec, read_headers(model_dir)):
        return None
    stored = detect_expert_format(model_dir, spec)
    if not EXECUTABLE_PACKED.match(stored):
        return None
    g = stored.rsplit("g", 1)[1]
    style = stored.split("-", 1)[0]
    if style == "ct":
        f16 = _first_w1(model_dir, spec)["weight_scale"]["dtype"] == "F16"
        return PackedExperts(stored, f"w4g{g}-fp16" if f16 else f"w4g{g}", False)
    qc = _quantization_config(model_dir) or {}
    if qc.get("quant_method") != style:
        name = "GPTQ" if style == "gptq" else "AWQ"
        raise CmoeError(f"{model_dir}: the experts are {name} tensors but config.json has no {style} "
                        f"quantization_config, which says how their zero points are stored: restore the "
                        f"checkpoint's own config.json")
    return PackedExperts(stored, f"w4g{g}-fp16", style == "gptq" and gptq_layout(qc) == "gptq")


def executor_format(model_dir: str | Path, spec: ModelSpec) -> str | None:
    """The executor format a checkpoint's experts already are (w4gG for compressed-tensors W4A16,
    w4gG-fp16 for GPTQ and AWQ), or None for float experts, which the executor quantizes itself."""
    packed = packed_experts(model_dir, spec)
    return packed.fmt if packed else None
