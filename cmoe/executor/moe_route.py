"""The routing tables of a MoE layer's kernels, in plain torch: the (row, expert) pairs sorted
stably by expert, and per segment (one per distinct expert) its id, start and end. The
reference (`route_reference`) and the same tables written into the kernels' buffers with no
host sync (`route_into`: what the Triton route kernel writes, for pair counts past its
limit). A leaf module: the reference (`moe_kernel`) and the Triton host side both import it.
"""

from __future__ import annotations

import torch


def route_reference(topk_ids: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """The routing tables the kernels build on the device, in torch: pairs (m*k + j) sorted by
    expert (stable), and per segment (one per distinct id, in id order) its id, start and end."""
    flat = topk_ids.reshape(-1).long()
    srt, order = torch.sort(flat, stable=True)
    start = torch.ones_like(srt, dtype=torch.bool)
    start[1:] = srt[1:] != srt[:-1]
    idx = start.nonzero().reshape(-1)
    ends = torch.cat([idx[1:], torch.tensor([flat.numel()], device=flat.device)])
    return {"order": order.int(), "seg_expert": srt[idx].int(), "seg_start": idx.int(), "seg_end": ends.int()}


def route_into(topk_ids: torch.Tensor, order: torch.Tensor, sorted_ids: torch.Tensor, seg_e: torch.Tensor,
               seg_s: torch.Tensor, seg_end: torch.Tensor) -> None:
    """`route_reference`'s tables written into the kernels' int32 buffers as the route kernel
    writes them, in torch ops with no host sync (a CUDA graph may hold them): `order` and
    `sorted_ids` [P]; per segment (A = seg_e's length) its id, start and end, seg_e -1 past the
    last segment, and seg_s/seg_end there left as they were."""
    P, A = order.numel(), seg_e.numel()
    dev = topk_ids.device
    srt, idx = torch.sort(topk_ids.reshape(-1).to(torch.int32), stable=True)
    sorted_ids.copy_(srt)
    order.copy_(idx)
    step = srt[1:] != srt[:-1]
    first = torch.cat([step.new_ones(1), step])
    last = torch.cat([step, step.new_ones(1)])
    seg = torch.cumsum(first, 0) - 1
    i = torch.arange(P, dtype=torch.int32, device=dev)
    for dst, at, val in ((seg_e, first, srt), (seg_s, first, i), (seg_end, last, i + 1)):
        buf = torch.full((A + 1,), -1, dtype=torch.int32, device=dev)
        # entry A is scratch; masked_fill, not a torch.tensor(A) (a host-to-device copy, which a
        # CUDA graph capture refuses: the lean engine captures this past 512 pairs at large batch)
        buf.scatter_(0, seg.masked_fill(~(at & (seg < A)), A), val)
        dst.copy_(buf[:A] if dst is seg_e else torch.where(buf[:A] >= 0, buf[:A], dst))
