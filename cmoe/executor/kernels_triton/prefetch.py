"""The kernel of `cmoe.executor.prefetch`: one bulk L2 prefetch per weight row (see there)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 128                          # rows a program takes per step (one request per thread row)


@triton.jit
def _l2_prefetch(w_ptr, rows, stride, seg, ROWS: tl.constexpr):
    """Each program takes rows pid, pid + P, ... in steps of ROWS; one bulk prefetch per row."""
    r0 = tl.program_id(0) * ROWS
    step = tl.num_programs(0) * ROWS
    base = w_ptr.to(tl.pointer_type(tl.int8))
    for start in range(r0, rows, step):
        r = start + tl.arange(0, ROWS)
        p = base + r.to(tl.int64) * stride
        n = tl.where(r < rows, seg, 0)
        tl.inline_asm_elementwise("{ .reg .pred q; setp.ne.u32 q, $2, 0; "
                                  "@q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                                  "=r,l,r", [p, n], dtype=tl.int32, is_pure=False, pack=1)


def launch(w: torch.Tensor, rows: int, stride: int, seg: int, programs: int = 64) -> None:
    """Ask L2 for `seg` bytes at the start of each of w's `rows` rows, `stride` bytes apart (all
    multiples of 16, as `cmoe.executor.prefetch.row_segment` gives them), on the current stream."""
    grid = (max(1, min(programs, triton.cdiv(rows, ROWS))),)
    _l2_prefetch[grid](w, rows, stride, seg, ROWS=ROWS, num_warps=4)


