"""What every policy is made of: the plan it hands the engine for a MoE layer (`LayerPlan`, its
loads `Load`), and the base class `Policy` with the mechanics the ten share (LRU victims, making
experts resident, the exact plan). The calling protocol and the policies themselves are in
`cmoe.policy.policies`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cmoe.policy.pool import PoolLayout, SlotPool


@dataclass(frozen=True)
class Load:
    layer: int
    expert: int
    slot: int
    victim: int | None           # expert whose slot is overwritten, None for a free slot
    kind: str                    # demand, prefetch, commit, admit


@dataclass
class LayerPlan:
    gpu: list[int]                                   # experts computed on the GPU, in order
    cpu: list[int] = field(default_factory=list)     # experts computed on the CPU (fallback)
    loads: list[Load] = field(default_factory=list)  # issued now, in priority order
    skipped: list[int] = field(default_factory=list) # routed experts not computed (commit misses)
    slots: dict[int, int] = field(default_factory=dict)  # slot each GPU expert is read from


class Policy:
    name = "base"
    uses_prediction = False      # reads the next layer's predicted experts
    uses_future = False          # reads the trace's future (only a replayed trace has one)
    # traits the engines read instead of names
    holds_all = False            # every expert resident, never moved (the pool layout, the lean host step)
    cpu_experts = False          # computes missing experts on the CPU (host copies of the experts)
    commits = False              # decode computes only the experts committed a layer earlier (OWA weights)
    skips = False                # may leave routed experts out (commit's misses, adaptive's non-resident)
    depth = 1                    # layers of predictions read; > 1: plan and begin_pass get `ahead` (cmoe.policy.ahead)

    def __init__(self, layout: PoolLayout, num_experts: int, popularity: list[list[int]],
                 future: list | None = None):
        self.layout, self.E = layout, num_experts
        self.pool = SlotPool(layout)
        self.popularity = popularity
        self.freq = [[0] * num_experts for _ in layout.slots]
        self.decode = False
        self.warm()

    def warm(self) -> None:
        """Fill each block with its most used experts, as after a warm-up (not timed)."""
        for m, n in enumerate(self.layout.slots):
            for e in self.by_popularity(m)[:n]:
                self.pool.place(m, e, None)

    def by_popularity(self, m: int) -> list[int]:
        return sorted(range(self.E), key=lambda e: (-self.popularity[m][e], e))

    def begin_pass(self, decode: bool, pred0: list[int]) -> list[Load]:
        self.decode = decode
        return []

    def plan(self, m: int, needed: list[int], predicted_next: list[int] | None) -> LayerPlan:
        raise NotImplementedError

    # shared mechanics ---------------------------------------------------------------------
    def victim(self, m: int, protect: set[int]) -> int | None:
        """LRU: the oldest resident not protected."""
        return next((v for v in self.pool.where[m] if v not in protect), None)

    def ensure(self, m: int, experts: list[int], kind: str, protect: set[int],
               reusable: list[int] | None = None) -> tuple[list[Load], list[int]]:
        """Make `experts` resident in block m. Returns the loads and the experts placed, in order.
        `reusable`: experts already planned this layer that may be overwritten when nothing else can
        (given for the layer's own demand loads, never for prefetches)."""
        loads, placed = [], []
        for e in experts:
            if self.pool.resident(m, e):
                self.pool.touch(m, e)
                continue
            v = None
            if not self.pool.has_free(m):
                v = self.victim(m, protect)
                if v is None and reusable is not None:
                    # the batch needs more experts than the block has slots: overwrite one this
                    # layer computes earlier (hits first, then loads placed before this one)
                    v = next((r for r in reusable + placed if self.pool.resident(m, r)), None)
                if v is None:
                    continue                     # nothing may be evicted: leave it out
            slot = self.pool.place(m, e, v)
            loads.append(Load(m, e, slot, v, kind))
            placed.append(e)
        return loads, placed

    def exact_plan(self, m: int, needed: list[int], kind: str = "demand") -> LayerPlan:
        for e in needed:
            self.freq[m][e] += 1
        hits = [e for e in needed if self.pool.resident(m, e)]
        for e in hits:
            self.pool.touch(m, e)
        misses = [e for e in needed if e not in hits]
        slots = {e: self.pool.slot_of(m, e) for e in hits}
        loads, placed = self.ensure(m, misses, kind, protect=set(needed), reusable=hits)
        slots.update((ld.expert, ld.slot) for ld in loads)
        return LayerPlan(gpu=hits + placed, loads=loads, slots=slots)
