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
from pathlib import Path

from cmoe.core.checkpoint_experts import (_CANON, _FUSED, _PER_EXPERT, checkpoint_expert_bytes,
                                          checkpoint_expert_tensors, expert_tensors, first_unplain_expert)
from cmoe.core.checkpoint_format import detect_expert_format
from cmoe.core.errors import CmoeError
from cmoe.core.safetensors_header import (INDEX, MAX_HEADER, PICKLE_SUFFIXES, check_index, read_header,
                                          read_headers, safetensors_files, tensor_nbytes)
from cmoe.core.spec import ModelSpec, from_checkpoint

__all__ = ["EXECUTABLE_PACKED", "INDEX", "MAX_HEADER", "PICKLE_SUFFIXES", "check_checkpoint",
           "checkpoint_expert_bytes", "checkpoint_expert_tensors", "detect_expert_format", "executor_format",
           "read_header", "safetensors_files", "tensor_nbytes",
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
                            f"weights and compressed-tensors W4A16 (pack-quantized, symmetric, groups of 32-256) "
                            f"as stored; trace this checkpoint (cmoe trace) to simulate it instead")
    return spec


EXECUTABLE_PACKED = re.compile(r"^ct-w4g(32|64|128|256)$")      # quantized experts the executor runs as stored


def executor_format(model_dir: str | Path, spec: ModelSpec) -> str | None:
    """The executor format a checkpoint's experts already are (w4gG for compressed-tensors W4A16),
    or None for float experts, which the executor quantizes itself."""
    model_dir = Path(model_dir)
    if not first_unplain_expert(model_dir, spec, read_headers(model_dir)):
        return None
    fmt = detect_expert_format(model_dir, spec)
    return "w4g" + fmt.rsplit("g", 1)[1] if EXECUTABLE_PACKED.match(fmt) else None
