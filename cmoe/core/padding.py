"""Quantization padding: every expert of a block is padded to the block's largest size, so the GPU
pool is a set of equal slots that any expert of the block can use (CommitMoE, idea 1).

Slots are rounded up to SLOT_ALIGN bytes so that every slot starts on a boundary the int4 kernel's
vector loads accept and the CUDA caching allocator would itself use.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SLOT_ALIGN = 256  # bytes


def align(n: int, a: int = SLOT_ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class BlockPadding:
    moe_layer: int
    slot_bytes: int          # padded size of every slot of this block
    min_bytes: int
    max_bytes: int
    std_bytes: float         # population standard deviation of the experts' sizes
    waste_bytes: int         # sum over experts of (slot - size)

    @property
    def waste_fraction(self) -> float:
        return self.waste_bytes / (self.slot_bytes * self.num_experts) if self.slot_bytes else 0.0

    num_experts: int = 0


def block_padding(moe_layer: int, sizes: list[int]) -> BlockPadding:
    slot = align(max(sizes))
    return BlockPadding(moe_layer=moe_layer, slot_bytes=slot, min_bytes=min(sizes), max_bytes=max(sizes),
                        std_bytes=statistics.pstdev(sizes), waste_bytes=sum(slot - s for s in sizes),
                        num_experts=len(sizes))


def padding_table(sizes: list[list[int]]) -> list[BlockPadding]:
    """One BlockPadding per MoE layer from [moe_layer][expert] sizes."""
    return [block_padding(m, row) for m, row in enumerate(sizes)]


def slot_bytes(sizes: list[list[int]]) -> list[int]:
    return [align(max(row)) for row in sizes]
