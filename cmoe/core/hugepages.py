"""Host buffers on transparent huge pages (2 MiB), and how much of a buffer the kernel backed so.

The CPU experts stream their whole expert (93.6 MB for Mixtral-8x7B at W4A16) on every call. On
4 KiB pages that is ~23,000 pages a call, each a TLB miss and, on a virtual machine, a walk of two page
tables; hardware prefetchers stop at every page's edge. Where the kernel runs transparent huge
pages in `madvise` mode (the lent GPU hosts, and most distributions' default), a buffer gets 2 MiB
pages only if it asks, before its pages are touched: `huge_zeros` asks (a 2 MiB-aligned region of
a fresh anonymous mapping, `madvise(MADV_HUGEPAGE)`, then one touch per 2 MiB, which faults each in
whole). Where huge pages are `never`, or the kernel has none to give, the buffer is an ordinary one:
the request is a hint, the bytes are the same, and `huge_bytes` says what was granted.

torch's own switch (`THP_MEM_ALLOC_ENABLE=1`, read once per process) does the same for every large
CPU tensor; a per-buffer request keeps the choice local to the buffers that are streamed.
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:                     # torch is imported where a buffer is made: profiles read the words alone
    import torch

HUGE = 2 << 20
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP) -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), "" where unknown."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "")


def huge_zeros(shape: tuple[int, ...] | int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zeroed CPU tensor (uint8 unless `dtype`) whose bytes start on a 2 MiB boundary of a fresh
    anonymous mapping that asked for huge pages before first touch. Fresh, because an allocator may
    hand back memory already touched on small pages (glibc serves sizes below its moving mmap
    threshold, up to 32 MiB, from its heap), which the request no longer changes. Below 2 MiB, where
    huge pages are off, or where the request cannot be made: `torch.zeros`."""
    import torch
    dtype = dtype or torch.uint8
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n < HUGE or thp_mode() in ("", "never") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zero-filled, untouched
    raw = torch.frombuffer(m, dtype=torch.uint8)           # holds `m` while any view of it lives
    off = (-raw.data_ptr()) % HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, n)              # a hint: refused, the pages stay small
    except OSError:
        pass
    body = raw[off:off + n]
    body[::HUGE].zero_()                                   # first touch of each 2 MiB: its fault takes a huge page
    return body.view(dtype).view(shape)


def _smaps(path: str) -> list[tuple[int, int, int, bool]]:
    """(start, end, AnonHugePages bytes, asked for huge pages) of each mapping in an smaps file: the
    last from VmFlags' `hg` (madvise(MADV_HUGEPAGE) over the whole mapping; the kernel splits a
    mapping where the request starts and ends)."""
    out, cur = [], None
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            if "-" in words[0] and not words[0].endswith(":"):
                lo, hi = words[0].split("-")
                cur = [int(lo, 16), int(hi, 16), 0, False]
                out.append(cur)
            elif cur is not None and words[0] == "AnonHugePages:":
                cur[2] = int(words[1]) * 1024
            elif cur is not None and words[0] == "VmFlags:":
                cur[3] = "hg" in words[1:]
    return [tuple(c) for c in out]


def huge_bytes(tensors: list[torch.Tensor], path: str = "/proc/self/smaps") -> int | None:
    """Bytes of the tensors on huge pages, as far as smaps tells: of each mapping that asked for
    them (`huge_zeros`' bodies, torch's `THP_MEM_ALLOC_ENABLE` buffers) the bytes the tensors
    overlap times the mapping's share on huge pages; nothing of any other mapping (a heap that the
    kernel's `always` mode gave some huge pages cannot say which bytes have them). None where smaps
    cannot be read."""
    try:
        maps = _smaps(path)
    except OSError:
        return None
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    total = 0.0
    for lo, hi, huge, asked in maps:
        if asked and huge:
            over = sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)
            total += over * min(huge / (hi - lo), 1.0)
    return round(total)


def huge_share(tensors: list[torch.Tensor]) -> float | None:
    """The share of the tensors' bytes on huge pages (0 to 1); None where unknown or no bytes."""
    n = sum(t.numel() * t.element_size() for t in tensors)
    got = huge_bytes(tensors) if n else None
    return None if got is None else got / n


def pages_word(share: float | None) -> str | None:
    """How a record names a share: "2 MiB pages" where most bytes are, else "4 KiB pages"."""
    return None if share is None else ("2 MiB pages" if share >= 0.5 else "4 KiB pages")
