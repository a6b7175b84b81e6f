"""The executor's named records: one pass's input, one layer's plan as executed, and a run's log
(the metrics record both engines fill, `cmoe.core.metrics.RunRecord`, plus the plans)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cmoe.core.metrics import RunRecord


@dataclass
class PassInput:
    index: int
    decode: bool
    input_ids: torch.Tensor                  # [B, n]
    position_ids: torch.Tensor               # [B, n]
    attention_mask: torch.Tensor | None      # [B, past + n] or None
    active: np.ndarray                       # [B*n] bool: rows that are real tokens (not padding)
    replay: dict | None = None               # trace rows: experts/weights/pred [B*n, M, K]


@dataclass
class PlanRecord:
    pass_index: int
    layer: int                 # MoE layer; -1 for the loads issued when the pass begins
    needed: tuple
    predicted_next: tuple | None
    loads: tuple
    gpu: tuple
    cpu: tuple
    skipped: tuple
    physical: tuple            # (slot -> expert) after the loads were issued
    logical: tuple             # the policy's pool index, as (slot -> expert)


@dataclass
class RunLog(RunRecord):
    plans: list = field(default_factory=list)
    slot_mismatches: int | None = None     # slots whose bytes differ from their expert's (checked on request)
    host_calls: str = "host"               # runtime, torch or host: what timed and ordered the run (`Clock.calls`)
    late_events: int = 0                   # timing events made during the passes (`Clock.late`)
    host_program: bool = False             # its graphed decode passes ran the compiled host program
    few_experts: str | None = None         # the few-expert thresholds its graphs were captured under
                                           # (None: no launch could switch, or no capture)
    clock_epoch: float = 0.0               # the wall clock (epoch s) at the timeline's zero (`Clock.epoch0`)
    host_core: int | None = None           # the core its passes' thread was pinned to (`cmoe.executor.affinity`)
    cpu_ref_us: tuple = ()                 # the host CPU's plain loop before and after its passes (`cmoe.core.cpu_ref`)


def _loads(loads) -> tuple:
    return tuple((ld.layer, ld.expert, ld.slot, ld.victim, ld.kind) for ld in loads)


def _slot_table(where, n: int) -> list[int]:
    t = [-1] * n
    for e, s in where.items():
        t[s] = e
    return t


def _expert_to_slot(where: dict, E: int) -> list[int]:
    """The inverse of `_slot_table`: expert -> slot (-1: not resident), for E experts."""
    t = [-1] * E
    for e, s in where.items():
        t[e] = s
    return t
