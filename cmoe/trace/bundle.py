"""Trace bundles: routing decisions of a run plus the exact expert sizes, on disk as a directory.

```
BUNDLE/
  meta.json            format, version, model spec, quant recipe, expert bytes, source, dataset
  routes.safetensors   dense arrays, T tokens, M MoE layers, K = top_k, E experts:
      experts       int16   [T, M, K]  chosen experts, highest weight first
      weights       float32 [T, M, K]  their weights as the model applied them (see meta
                                       `weights_renormalized` and the spec's `scaling`)
      pred_experts  int16   [T, M, K]  commit prediction for layer m: layer m's router applied to
                                       the hidden state that exists while layer m-1 runs; -1 = none
      pred_ahead    int16   [T, M, D, K]  optional, predictions for layer m from further back:
                                       [:, m, k-1] is layer m's router applied to the hidden state
                                       that predicts layer m-k+1 (distance k); [:, :, 0] equals
                                       pred_experts; -1 where m < k-1 (no such state)
      request       int32   [T]        request (prompt) index
      step          int32   [T]        position of the token within its request
      phase         uint8   [T]        0 prefill, 1 decode
      token_ids     int32   [T]        optional
      router_logits float32 [T, M, E]  optional, the full router logits
  routes.parquet       optional, one row per token and layer, for polars users
```
Tokens are stored in the order they were processed. A bundle is written under a temporary name
and renamed into place, so a reader never sees half of one. The reader checks everything and
reports the first problem as one line. Imports neither torch nor simpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from cmoe import __version__
from cmoe.core.errors import CmoeError
from cmoe.core.padding import slot_bytes
from cmoe.core.quant import QuantRecipe
from cmoe.core.spec import ModelSpec
from cmoe.core.util import atomic_dir

FORMAT = "cmoe-trace"
FORMAT_VERSION = 1
PREFILL, DECODE = 0, 1
_REQUIRED = {"experts": np.int16, "weights": np.float32, "pred_experts": np.int16,
             "request": np.int32, "step": np.int32, "phase": np.uint8}
_OPTIONAL = {"token_ids": np.int32, "router_logits": np.float32, "pred_ahead": np.int16}


def fingerprint(t: "Trace") -> str:
    """A short id of a trace's routing (model, routes, predictions, token order), so results from
    different engines can be checked to come from the same trace."""
    import hashlib
    h = hashlib.sha256(t.spec.name.encode())
    for a in (t.experts, t.pred_experts, t.request, t.step, t.phase):
        h.update(np.ascontiguousarray(a).tobytes())
    if t.pred_ahead is not None and t.depth > 1:
        h.update(np.ascontiguousarray(t.pred_ahead).tobytes())
    return h.hexdigest()[:16]


@dataclass
class Trace:
    experts: np.ndarray          # [T, M, K] int16
    weights: np.ndarray          # [T, M, K] float32
    pred_experts: np.ndarray     # [T, M, K] int16
    request: np.ndarray          # [T] int32
    step: np.ndarray             # [T] int32
    phase: np.ndarray            # [T] uint8
    spec: ModelSpec
    recipe: QuantRecipe
    expert_bytes: list[list[int]]            # [M][E]
    source: dict = field(default_factory=dict)
    token_ids: np.ndarray | None = None
    router_logits: np.ndarray | None = None
    pred_ahead: np.ndarray | None = None     # [T, M, D, K] int16, distance k at [:, :, k-1]

    @property
    def depth(self) -> int:
        """How many layers ahead the trace's predictions reach (1: pred_experts only)."""
        return 1 if self.pred_ahead is None else int(self.pred_ahead.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def cache_slots(self) -> int:
        """KV-cache slots a run of this trace needs, and the executor allocates: its last step + 1
        (1 for an empty trace). The simulator sizes the pool's budget and the decode attention's runs
        by it, as the executor does."""
        return int(self.step.max()) + 1 if self.num_tokens else 1

    @property
    def slot_bytes(self) -> list[int]:
        return slot_bytes(self.expert_bytes)

    def arrays(self) -> dict[str, np.ndarray]:
        a = {k: np.ascontiguousarray(getattr(self, k), dtype=t) for k, t in _REQUIRED.items()}
        for k, t in _OPTIONAL.items():
            if getattr(self, k) is not None:
                a[k] = np.ascontiguousarray(getattr(self, k), dtype=t)
        return a

    def meta(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "cmoe_version": __version__,
                "model": self.spec.to_dict(), "quant": self.recipe.to_dict(),
                "weights_renormalized": self.spec.renormalize, "expert_bytes": self.expert_bytes,
                "slot_bytes": self.slot_bytes, "source": self.source}


def validate(t: Trace) -> None:
    """Raise CmoeError with one line on the first inconsistency."""
    s = t.spec
    T = t.experts.shape[0] if t.experts.ndim == 3 else -1
    want = (T, s.num_moe_layers, s.top_k)
    for k in ("experts", "weights", "pred_experts"):
        if getattr(t, k).shape != want:
            raise CmoeError(f"trace array {k} has shape {getattr(t, k).shape}, expected {want} "
                            f"for {s.name} ({s.num_moe_layers} MoE layers, top-{s.top_k})")
    for k in ("request", "step", "phase") + (("token_ids",) if t.token_ids is not None else ()):
        if getattr(t, k).shape != (T,):
            raise CmoeError(f"trace array {k} has shape {getattr(t, k).shape}, expected ({T},)")
    if t.router_logits is not None and t.router_logits.shape != (T, s.num_moe_layers, s.num_experts):
        raise CmoeError(f"trace router_logits has shape {t.router_logits.shape}, expected "
                        f"{(T, s.num_moe_layers, s.num_experts)}")
    _validate_ahead(t, T)
    if T and (t.experts.min() < 0 or t.experts.max() >= s.num_experts):
        bad = int(t.experts.max() if t.experts.max() >= s.num_experts else t.experts.min())
        raise CmoeError(f"trace has expert id {bad} out of range 0..{s.num_experts - 1}: "
                        f"the trace does not belong to {s.name}")
    if T and (t.pred_experts.min() < -1 or t.pred_experts.max() >= s.num_experts):
        raise CmoeError(f"trace has predicted expert ids out of range -1..{s.num_experts - 1}")
    if not np.isfinite(t.weights).all():
        raise CmoeError("trace weights contain NaN or infinity")
    if T and np.any(np.sort(t.experts, axis=-1)[..., 1:] == np.sort(t.experts, axis=-1)[..., :-1]):
        raise CmoeError("trace routes one token to the same expert twice in one layer")
    if np.any(t.phase > DECODE):
        raise CmoeError("trace phase must be 0 (prefill) or 1 (decode)")
    eb = t.expert_bytes
    if len(eb) != s.num_moe_layers or any(len(r) != s.num_experts for r in eb):
        raise CmoeError(f"trace expert_bytes is not [{s.num_moe_layers}][{s.num_experts}]")
    if any(b <= 0 for r in eb for b in r):
        raise CmoeError("trace expert_bytes must be positive")


def _validate_ahead(t: Trace, T: int) -> None:
    a, s = t.pred_ahead, t.spec
    if a is None:
        return
    if a.ndim != 4 or a.shape[2] < 1 or a.shape[:2] + a.shape[3:] != (T, s.num_moe_layers, s.top_k):
        raise CmoeError(f"trace array pred_ahead has shape {a.shape}, expected ({T}, {s.num_moe_layers}, D, {s.top_k})")
    if T and (a.min() < -1 or a.max() >= s.num_experts):
        raise CmoeError(f"trace has pred_ahead expert ids out of range -1..{s.num_experts - 1}")
    if not np.array_equal(a[:, :, 0], t.pred_experts):
        raise CmoeError("trace pred_ahead at distance 1 differs from pred_experts: re-create the bundle")


MARKER = ("meta.json",)          # a bundle always has it: --force replaces only bundles


def write(t: Trace, path: str | Path, overwrite: bool = False, parquet: bool = False) -> Path:
    """Write a bundle atomically: build it under a temporary name, then rename it into place
    (`overwrite`: replace an existing bundle whole)."""
    validate(t)
    path = Path(path)
    with atomic_dir(path, overwrite, MARKER) as tmp:
        save_file(t.arrays(), str(tmp / "routes.safetensors"), metadata={"format": FORMAT})
        (tmp / "meta.json").write_text(json.dumps(t.meta(), indent=1, sort_keys=True) + "\n")
        if parquet:
            from cmoe.trace.tables import write_routes_parquet
            write_routes_parquet(t, tmp / "routes.parquet")
    return path


def read(path: str | Path) -> Trace:
    path = Path(path)
    if path.is_file():
        raise CmoeError(f"{path} is a file, and a trace bundle is a folder made by `cmoe trace`: "
                        f"turn a routing log into one with `cmoe trace --import {path} --spec PRESET --out BUNDLE`")
    if not path.is_dir():
        raise CmoeError(f"trace bundle {path} does not exist (a bundle is a folder made by `cmoe trace`)")
    meta_path, routes_path = path / "meta.json", path / "routes.safetensors"
    if not meta_path.is_file() or not routes_path.is_file():
        raise CmoeError(f"{path} is not a trace bundle: it lacks meta.json or routes.safetensors")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CmoeError(f"{meta_path} is corrupted (not JSON): re-create the bundle with `cmoe trace`") from None
    if meta.get("format") != FORMAT:
        raise CmoeError(f"{path} is not a cmoe trace bundle (format {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CmoeError(f"{path} is trace format version {meta.get('format_version')}, this cmoe reads "
                        f"version {FORMAT_VERSION}: upgrade cmoe or re-create the bundle")
    try:
        arrays = load_file(str(routes_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CmoeError(f"{routes_path} is corrupted ({str(e).splitlines()[0]}): re-create the bundle") from None
    for k, dt in _REQUIRED.items():
        if k not in arrays:
            raise CmoeError(f"{routes_path} lacks the array '{k}': re-create the bundle")
        if arrays[k].dtype != dt:
            raise CmoeError(f"{routes_path}: array {k} is {arrays[k].dtype}, expected {np.dtype(dt)}")
    try:
        spec = ModelSpec.from_dict(meta["model"])
        rec = QuantRecipe.from_dict(meta["quant"])
        eb = [[int(b) for b in row] for row in meta["expert_bytes"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CmoeError(f"{meta_path} is missing or has a bad field ({e}): re-create the bundle") from None
    t = Trace(**{k: arrays[k] for k in _REQUIRED}, spec=spec, recipe=rec, expert_bytes=eb,
              source=meta.get("source", {}), **{k: arrays.get(k) for k in _OPTIONAL})
    validate(t)
    return t
