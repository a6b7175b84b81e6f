"""Checks `cmoe execute` makes before anything is built, each failing in one line that says what
to do: the device named, the trace against the model, a policy file, host memory, and whether
the pool and each policy's allocations fit the GPU's free memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cmoe.core.errors import CmoeError
from cmoe.core.spec import ModelSpec
from cmoe.policy.policies import trait
from cmoe.policy.pool import PoolLayout
from cmoe.trace.bundle import Trace

_MATCH = ("family", "num_layers", "hidden", "expert_ffn", "num_experts", "top_k", "moe_layers")


def resolve_device(name: str) -> torch.device:
    if name in ("cuda", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if name == "cuda":
            raise CmoeError("no CUDA GPU is visible here: pass --device cpu to run the same engine on the CPU")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise CmoeError("no CUDA GPU is visible here: pass --device cpu to run the same engine on the CPU")
        return torch.device(name)
    raise CmoeError(f"unknown device '{name}': use cuda, cuda:N or cpu")


def check_trace_matches(trace: Trace, spec: ModelSpec) -> None:
    diff = [k for k in _MATCH if getattr(trace.spec, k) != getattr(spec, k)]
    if diff:
        k = diff[0]
        raise CmoeError(f"the trace was recorded on {trace.spec.name} ({k} = {getattr(trace.spec, k)}) but the model "
                        f"is {spec.name} ({k} = {getattr(spec, k)}): trace this model with cmoe trace")


def read_policy_json(path: Path, spec: ModelSpec) -> tuple[str, float, int, PoolLayout]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CmoeError(f"cannot read policy file {path}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != "cmoe-policy":
        raise CmoeError(f"{path} is not a cmoe policy file (written by cmoe simulate --out)")
    if d.get("format_version") != 1:
        raise CmoeError(f"{path} has policy format version {d.get('format_version')}; this cmoe reads version 1")
    if d.get("model") != spec.name:
        raise CmoeError(f"{path} was made for {d.get('model')}, not {spec.name}")
    lay = d["layout"]
    layout = PoolLayout(tuple(lay["slot_bytes"]), tuple(lay["slots"]), int(d["budget"]["expert_bytes"]))
    if len(layout.slots) != spec.num_moe_layers:
        raise CmoeError(f"{path} has {len(layout.slots)} blocks but {spec.name} has {spec.num_moe_layers} MoE layers")
    return d["policy"], float(d["pool_gb"]), int(d["batch"]), layout


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_gpu_fits(need: dict[str, int], pool_gb: float, free: int, gpu: str) -> None:
    """The pool, and what each policy really allocates (upper holds every expert), against free memory."""
    if pool_gb * 1e9 > free and any(not trait(p, "holds_all") for p in need):
        raise CmoeError(f"a {pool_gb:g} GB pool does not fit the {free / 1e9:.1f} GB free on the {gpu}: lower --pool-gb")
    for p, n in need.items():
        if n > free:
            raise CmoeError(f"policy {p} needs {n / 1e9:.1f} GB on the {gpu} but {free / 1e9:.1f} GB is free: "
                            f"lower --pool-gb or drop '{p}'")
