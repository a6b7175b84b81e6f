"""Scratch for the kernels whose programs hand partial results to the last of them to finish
(`steps.route_mm_topk`, the split `attention.decode_attention`): fp32 buffers for the parts and
int32 counters at zero, which each launch's last programs reset to zero.

One set per (owner, device, sizes), shared by every launch of that shape: their launches are
ordered on one stream. Two launches of one shape running at once (two streams, two engines
overlapping) are not supported: they would share the counters. A set is made at the first
(warm-up) call, outside any CUDA graph capture: zeros made in a capture would exist only in its
replays, so making one there raises.
"""

from __future__ import annotations

import torch

_SETS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def counted(owner: str, device, sizes: tuple[int, ...], counters: int) -> tuple[torch.Tensor, ...]:
    """(fp32 buffer of each size in `sizes`, ..., `counters` int32 counters at zero) for `owner`."""
    key = (owner, torch.device(device), tuple(sizes), counters)
    if key not in _SETS:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: call it once outside the CUDA graph capture first (a warm-up)")
        _SETS[key] = tuple(torch.empty(n, dtype=torch.float32, device=device) for n in sizes) + (
            torch.zeros(counters, dtype=torch.int32, device=device),)
    return _SETS[key]


def counters(owner: str) -> list[torch.Tensor]:
    """Every counter tensor made for `owner` so far (tests check they are back at zero)."""
    return [v[-1] for k, v in _SETS.items() if k[0] == owner]
