"""The expert pool's bookkeeping, pure Python (no simpy, no torch), shared by simulator and executor.

`SlotPool`: one GPU buffer carved into per-block regions of equal, padded slots; an index
`(layer, expert) -> slot`; each block's slots kept in recency order so eviction is LRU unless a
policy asks otherwise. `VariableAllocator` is the unpadded alternative: exact sizes, first fit,
holes coalesced on free; it really fragments, which is what padding avoids.
Legend: M MoE layers, E experts per layer, c_m slots of block m.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cmoe.core.errors import CmoeError
from cmoe.core.padding import align


@dataclass(frozen=True)
class PoolLayout:
    slot_bytes: tuple[int, ...]      # [M] padded slot size of each block
    slots: tuple[int, ...]           # [M] slots of each block
    budget_bytes: int                # bytes available for experts

    @property
    def used_bytes(self) -> int:
        return sum(s * n for s, n in zip(self.slot_bytes, self.slots))

    @property
    def total_slots(self) -> int:
        return sum(self.slots)


def layout_for_policy(policy: str, slot_bytes, num_experts: int, top_k: int, budget_bytes: int,
                      slots: int | None = None) -> PoolLayout:
    """The one pool layout rule both engines use: `upper` holds every expert; `slots` pins the
    slots per block (between top_k and the expert count); otherwise `plan_layout` fills the budget."""
    slot_bytes = tuple(slot_bytes)
    if policy == "upper":
        return PoolLayout(slot_bytes, (num_experts,) * len(slot_bytes), sum(slot_bytes) * num_experts)
    if slots is not None:
        if not top_k <= slots <= num_experts:
            raise CmoeError(f"--slots must lie between top_k ({top_k}) and the expert count ({num_experts})")
        n = (slots,) * len(slot_bytes)
        return PoolLayout(slot_bytes, n, sum(a * b for a, b in zip(slot_bytes, n)))
    return plan_layout(list(slot_bytes), num_experts, budget_bytes, top_k)


def plan_layout(slot_bytes: list[int], num_experts: int, budget_bytes: int, min_slots: int) -> PoolLayout:
    """Equal slot counts per block, the leftover bytes going one slot at a time to blocks in order.
    A block never gets more slots than it has experts."""
    per_round = sum(slot_bytes)
    c = min(num_experts, max(budget_bytes, 0) // per_round)
    slots = [c] * len(slot_bytes)
    left = budget_bytes - c * per_round
    for m, sb in enumerate(slot_bytes):
        if c < num_experts and left >= sb:
            slots[m] += 1
            left -= sb
    if min(slots) < min_slots:
        need = sum(min_slots * s for s in slot_bytes)
        raise CmoeError(f"the expert pool gets {budget_bytes / 1e9:.2f} GB, but every MoE layer needs at least "
                        f"{min_slots} slots (top-k) of its padded size: {need / 1e9:.2f} GB; raise --pool-gb")
    return PoolLayout(tuple(slot_bytes), tuple(slots), budget_bytes)


class SlotPool:
    """Which expert sits in which slot; per block, residents in LRU order (oldest first)."""

    def __init__(self, layout: PoolLayout):
        self.layout = layout
        self.where: list[OrderedDict[int, int]] = [OrderedDict() for _ in layout.slots]   # expert -> slot
        self.free: list[list[int]] = [list(range(n - 1, -1, -1)) for n in layout.slots]

    def resident(self, m: int, e: int) -> bool:
        return e in self.where[m]

    def slot_of(self, m: int, e: int) -> int:
        return self.where[m][e]

    def touch(self, m: int, e: int) -> None:
        self.where[m].move_to_end(e)

    def residents(self, m: int) -> list[int]:
        return list(self.where[m])

    def occupancy(self) -> int:
        return sum(len(w) for w in self.where)

    def place(self, m: int, e: int, victim: int | None) -> int:
        """Put expert e of block m into a free slot, or into `victim`'s slot. Returns the slot."""
        assert e not in self.where[m], f"expert {e} of layer {m} is already resident"
        if victim is None:
            assert self.free[m], f"layer {m} has no free slot and no victim was chosen"
            slot = self.free[m].pop()
        else:
            slot = self.where[m].pop(victim)
        self.where[m][e] = slot
        return slot

    def has_free(self, m: int) -> bool:
        return bool(self.free[m])


class VariableAllocator:
    """Unpadded, variable-size allocation in one region: first fit, coalescing free. Fragments."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes: list[tuple[int, int]] = [(0, capacity)]        # (offset, size), sorted by offset
        self.blocks: dict[object, tuple[int, int]] = {}

    def alloc(self, key, size: int) -> int | None:
        size = align(size)
        for i, (off, sz) in enumerate(self.holes):
            if sz >= size:
                self.holes[i:i + 1] = [(off + size, sz - size)] if sz > size else []
                self.blocks[key] = (off, size)
                return off
        return None

    def free(self, key) -> None:
        off, size = self.blocks.pop(key)
        self.holes.append((off, size))
        self.holes.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.holes = merged

    @property
    def free_bytes(self) -> int:
        return sum(s for _, s in self.holes)


def residency_comparison(routes: list[list[list[int]]], sizes: list[list[int]], layout: PoolLayout) -> dict:
    """Replay per-block LRU caching of `routes` ([pass][layer] -> experts needed) through padded
    slots and through the unpadded allocator with the same bytes per block. Returns the mean
    number of resident experts and the loads each needed."""
    out = {}
    for kind in ("padded", "unpadded"):
        resident_sum, loads, samples = 0, 0, 0
        for m, (sb, n) in enumerate(zip(layout.slot_bytes, layout.slots)):
            lru: OrderedDict[int, None] = OrderedDict()
            heap = VariableAllocator(sb * n)
            for step in routes:
                need = step[m]
                for e in need:
                    if e in lru:
                        lru.move_to_end(e)
                        continue
                    loads += 1
                    if kind == "padded":
                        if len(lru) >= n:
                            lru.popitem(last=False)
                    else:
                        while heap.alloc(e, sizes[m][e]) is None:
                            # fragmentation may force out an expert this layer still needs
                            victim = next((v for v in lru if v not in need), None)
                            victim = next(iter(lru)) if victim is None else victim
                            del lru[victim]
                            heap.free(victim)
                    lru[e] = None
                resident_sum += len(lru)
                samples += 1
        out[kind] = {"mean_resident": resident_sum / samples * len(layout.slots) if samples else 0.0,
                     "loads": loads}
    return out
