"""Host buffers on transparent huge pages (2 MiB), and how much of a buffer the kernel backed so.

The CPU experts stream their whole expert (89 MB for Mixtral-8x7B at W4A16) on every call. On 4 KiB
pages that is ~22,000 pages a call, each a TLB miss and, on a virtual machine, a walk of two page
tables; hardware prefetchers stop at every page's edge. Where the kernel runs transparent huge
pages in `madvise` mode (the lent GPU hosts, and most distributions' default), a buffer gets 2 MiB
pages only if it asks, before its pages are touched: `huge_zeros` asks (an aligned region of a
fresh, untouched allocation, `madvise(MADV_HUGEPAGE)`, then zeroed, which faults it in). Where huge
pages are `never`, or the kernel has none to give, the buffer is an ordinary one: the request is a
hint, the bytes are the same, and `huge_bytes` says what was granted.

torch's own switch (`THP_MEM_ALLOC_ENABLE=1`, read once per process) does the same for every large
CPU tensor; a per-buffer request keeps the choice local to the buffers that are streamed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP) -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), "" where unknown."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "")


def _madvise(addr: int, n: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), MADV_HUGEPAGE) == 0


def huge_zeros(shape: tuple[int, ...] | int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A zeroed CPU tensor whose bytes start on a 2 MiB boundary and were asked for huge pages
    before first touch. Below 2 MiB, or where the request cannot be made, `torch.zeros`."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape) * size
    if n < HUGE or thp_mode() in ("", "never"):
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(n + HUGE, dtype=torch.uint8)         # untouched: torch.empty writes nothing
    off = (-raw.data_ptr()) % HUGE
    body = raw[off:off + n]
    _madvise(body.data_ptr(), n)                           # a hint: refused, the pages are small ones
    body.zero_()                                           # first touch: the faults take huge pages
    return body.view(dtype).view(shape)                    # the view keeps `raw` alive


def _smaps(path: str) -> list[tuple[int, int, int]]:
    """(start, end, AnonHugePages bytes) of each mapping in an smaps file."""
    out, cur = [], None
    with open(path) as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                cur = [int(lo, 16), int(hi, 16), 0]
                out.append(cur)
            elif head == "AnonHugePages:" and cur is not None:
                cur[2] = int(line.split()[1]) * 1024
    return [tuple(c) for c in out]


def huge_bytes(tensors: list[torch.Tensor], path: str = "/proc/self/smaps") -> int | None:
    """Bytes of the tensors' storage the kernel backs with huge pages (the mappings they overlap,
    each counted once, at most the bytes overlapped); None where smaps cannot be read."""
    try:
        maps = _smaps(path)
    except OSError:
        return None
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    total = 0
    for lo, hi, huge in maps:
        over = sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)
        if over:
            total += min(huge, over)
    return total
