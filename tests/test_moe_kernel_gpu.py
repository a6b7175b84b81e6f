"""The Triton MoE-layer kernels against the plain-torch reference computed from the same slot bytes.

On CUDA (marked `gpu`, skipped without it): every group size, several batch sizes (one row chunk
and several), k tails, both unpacking paths, split-K of w13 (even and uneven, against the unsplit
h, run to run bit-identical), experts without a slot, padding ids, and CUDA-graph replays on new
inputs (split and unsplit).

In Triton's CPU interpreter (run with `TRITON_INTERPRET=1` where triton is importable; skipped
otherwise, and skipped on CUDA runs): the split-K w13 path on CPU tensors, split13 in {1, 2, 4}
x M in {1, 3, 16} x every group size, tails, skipped experts, with every scratch buffer filled
with NaN first (so nothing is read that the same call did not write). No inline PTX there (asm=False).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from cmoe.executor.layout import slot_size
from cmoe.executor.moe_kernel import moe_forward, moe_reference, route_reference, tiled_layout, write_codes

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs CUDA (and not TRITON_INTERPRET=1)")
needs_interpreter = pytest.mark.skipif(not (HAVE_TRITON and INTERPRET),
                                       reason="Triton's interpreter: needs triton and TRITON_INTERPRET=1")

# (group, H, F): the last two of g=32/64 have K % 128 != 0 in one matrix or both (the tail regions)
SHAPES = [(32, 512, 384), (32, 192, 160), (64, 256, 512), (64, 192, 320), (128, 512, 384), (256, 512, 768)]


def _pool(E: int, S: int, H: int, Fd: int, g: int, gen: torch.Generator, device="cuda"):
    lay = tiled_layout(f"w4g{g}", H, Fd)
    pool = torch.full((S, slot_size(lay)), 0xFF, dtype=torch.uint8, device=device)
    perm = torch.randperm(S, generator=gen, device=device)[:E]
    for e in range(E):
        for name, (n, k) in (("w13", (2 * Fd, H)), ("w2", (H, Fd))):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen, device=device)
            sz = torch.stack([torch.rand(k // g, n, generator=gen, device=device) * 0.02 + 0.001,
                              (torch.rand(k // g, n, generator=gen, device=device) - 0.5) * 0.1], -1)
            write_codes(pool[int(perm[e])], lay, name, codes, sz.to(torch.bfloat16))
    return lay, pool, perm.int()


def _inputs(M: int, k: int, E: int, H: int, gen: torch.Generator, device="cuda"):
    x = torch.randn(M, H, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device=device)[:k] for _ in range(M)]).int()
    wts = torch.rand(M, k, generator=gen, device=device)
    return x, ids, wts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _h_rel(ws, ref_ws, M: int, k: int, E: int, ids, table) -> float:
    """h of the rows the kernels compute (real segments), this workspace against ref_ws."""
    r = route_reference(ids, E)
    rows = [p for p in range(M * k)
            if 0 <= int(ids.reshape(-1)[int(r["order"][p])]) < E
            and int(table[int(ids.reshape(-1)[int(r["order"][p])])]) >= 0]
    idx = torch.tensor(rows, dtype=torch.long, device=ws.h.device)
    return _rel(ws.h.index_select(0, idx), ref_ws.h.index_select(0, idx))


# --- CUDA --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g,H,Fd,asm,deq", [(*s, True, d) for s in SHAPES for d in (True, False)]
                         + [(*SHAPES[1], False, True), (*SHAPES[4], False, False)])
@pytest.mark.gpu
@needs_cuda
def test_triton_layer_matches_the_reference(g, H, Fd, asm, deq):
    """deq: weights dequantized to bf16 in registers (a bf16 rounding each, as torch's tinygemm does);
    else the group's affine part applied in fp32 to exact dots of the codes."""
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(g * 7 + H + asm)
    E, S, k = 8, 11, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    for M in (1, 3, 16, 37, 64):
        x, ids, wts = _inputs(M, k, E, H, gen)
        ws = Workspace(M, k, H, Fd, E, "cuda")
        ws.h.fill_(float("nan"))
        ws.acc.fill_(float("nan"))
        cfg = replace(pick_config(M, triton_only=True), asm=asm, deq=deq, deq2=deq)
        got = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        err = _rel(got, ref)
        assert err < (1e-2 if deq else 5e-3), (M, err)
        r = route_reference(ids, E)
        assert torch.equal(ws.order, r["order"])
        n = r["seg_expert"].numel()
        assert torch.equal(ws.seg_e[:n], r["seg_expert"]) and bool((ws.seg_e[n:] == -1).all())


@pytest.mark.parametrize("split13", [2, 3, 8])
@pytest.mark.parametrize("g,H,Fd", SHAPES)
@pytest.mark.gpu
@needs_cuda
def test_split13_matches_the_reference_and_the_unsplit_h(g, H, Fd, split13):
    """Split-K of w13 (partials in Workspace.part, summed by the reduction kernel): the layer as the
    reference, h as the unsplit kernel's (they differ only in the order of fp32 sums), and two runs
    bit-identical (no atomics in w13's path). Scratch starts as NaN: only what is written is read.
    3 splits of 4 units (g = 128, 256 at H = 512) are uneven; 8 is more than the units (capped)."""
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(g * 13 + H + split13)
    E, S, k = 8, 11, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    for M in (1, 3, 16, 37, 64):
        x, ids, wts = _inputs(M, k, E, H, gen)
        base = pick_config(M, triton_only=True)
        for deq in ((True, False) if M in (1, 16) else (base.deq,)):
            cfg = replace(base, split13=split13, deq=deq)
            ws = Workspace(M, k, H, Fd, E, "cuda")
            ws.h.fill_(float("nan"))
            ws.acc.fill_(float("nan"))
            ws.split_buffers(split13).fill_(float("nan"))
            got = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32).clone()
            h1 = ws.h.clone()
            ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
            err = _rel(got, ref)
            assert err < (1e-2 if deq else 5e-3), (M, deq, err)
            got2 = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
            assert torch.equal(ws.h, h1), (M, deq)
            assert _rel(got2, ref) < (1e-2 if deq else 5e-3)
            ws1 = Workspace(M, k, H, Fd, E, "cuda")
            moe_forward(x, ids, wts, table, pool, lay, workspace=ws1, config=replace(cfg, split13=1))
            assert _h_rel(ws, ws1, M, k, E, ids, table) < 5e-3, (M, deq)


@pytest.mark.gpu
@needs_cuda
def test_row_chunks_split_k_and_skipped_experts():
    """More rows per expert than a CTA's row block (several chunks), splits the units do not
    divide (w2 and w13), unrolled unit loops, unit loops with their own stages, an expert whose slot
    is -1 and padding ids -1: all as the reference."""
    from cmoe.executor.kernels_triton import KernelConfig
    gen = torch.Generator(device="cuda").manual_seed(5)
    g, H, Fd, E, S, k, M = 64, 448, 640, 4, 6, 2, 50          # w13: 3 units + a 64 tail
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    x, ids, wts = _inputs(M, k, E, H, gen)
    table[int(ids[0, 0])] = -1
    ids[3, 1] = -1
    for cfg in (KernelConfig(16, 32, 4, 2, 64, 3, 4, 2, deq=False, deq2=False),
                KernelConfig(16, 32, 1, 4, 32, 3, 1, 4),
                KernelConfig(16, 32, 2, 3, 64, 7, 1, 3, deq=False, deq2=False),
                KernelConfig(32, 64, 4, 3, 32, 7, 4, 3, asm=False),
                KernelConfig(16, 32, 2, 3, 64, 3, 1, 3, deq=False, deq2=False, split13=2),
                KernelConfig(16, 64, 2, 3, 64, 3, 1, 3, deq=True, deq2=False, split13=3),
                KernelConfig(32, 64, 4, 3, 32, 7, 4, 3, asm=False, split13=8),
                # the unit loop unrolled: 2 and 4 do not divide w13's 3 units, 3 not w2's 5
                KernelConfig(16, 32, 2, 3, 64, 1, 1, 3, deq=False, deq2=False, unroll13=2, unroll2=3),
                KernelConfig(16, 16, 1, 3, 32, 2, 1, 2, unroll13=4, unroll2=2),
                KernelConfig(16, 32, 2, 3, 64, 3, 1, 3, deq=False, deq2=True, split13=2, unroll13=2, unroll2=4),
                # the unit loop's own stages (its loads pipelined): 2 to 4, with a split and an unroll
                KernelConfig(16, 32, 2, 3, 64, 3, 1, 3, deq=False, deq2=False, stg13=3, stg2=4),
                KernelConfig(16, 32, 2, 3, 64, 7, 1, 3, deq=True, deq2=True, stg13=2, stg2=2, split13=2),
                KernelConfig(16, 16, 1, 3, 32, 2, 1, 2, stg13=4, stg2=3, unroll13=2)):
        got = moe_forward(x, ids, wts, table, pool, lay, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(got, ref) < (5e-3 if not cfg.deq else 1e-2), cfg


@pytest.mark.parametrize("split13", [1, 4])
@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_on_new_inputs(split13):
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(9)
    g, H, Fd, E, S, k, M = 128, 512, 384, 8, 8, 2, 4
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    x, ids, wts = _inputs(M, k, E, H, gen)
    ws = Workspace(M, k, H, Fd, E, "cuda")
    cfg = replace(pick_config(M, triton_only=True), split13=split13)
    moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)   # compile (and size) outside the capture
    torch.cuda.synchronize()
    part = ws.part
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)
    assert ws.part is part                       # nothing allocated in the capture
    for _ in range(3):
        x2, ids2, wts2 = _inputs(M, k, E, H, gen)
        x.copy_(x2)
        ids.copy_(ids2)
        wts.copy_(wts2)
        table.copy_(table[torch.randperm(E, generator=gen, device="cuda")])  # experts moved between slots
        graph.replay()
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(out.float(), ref) < 1e-2      # bf16 output


# --- Triton's interpreter (CPU tensors) ------------------------------------------------------------

# (group, H, F): H (w13's K) 3 units + a 64-k tail (g = 32: uneven splits, capped at 3), 2 units +
# tail (g = 64), 4 units (g = 128), 2 units of 256 (g = 256); F (w2's K) with a 32-k tail for g = 32
ISHAPES = [(32, 448, 160), (64, 320, 192), (128, 512, 128), (256, 512, 256)]


@pytest.mark.parametrize("split13", [1, 2, 4])
@pytest.mark.parametrize("g,H,Fd", ISHAPES)
@pytest.mark.slow
@needs_interpreter
def test_interpreter_split13_layer_matches_the_reference(g, H, Fd, split13):
    """The layer as the reference (loosely: the interpreter casts fp32 to bf16 by truncation, not
    to nearest, so h is off by up to an ulp in about half its elements), and with split13 > 1 h as
    the unsplit kernel's h (tightly: they differ only by the order of fp32 sums)."""
    from cmoe.executor.kernels_triton import KernelConfig, Workspace, moe_triton
    from cmoe.executor.kernels_triton import moe as K
    gen = torch.Generator().manual_seed(g + H + split13)
    E, S, k = 3, 4, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen, "cpu")
    for M in (1, 3, 16):
        x, ids, wts = _inputs(M, k, E, H, gen, "cpu")
        tab = table.clone()
        if M == 16:                              # an expert without a slot, a padding id
            tab[int(ids[0, 0])] = -1
            ids[3, 1] = -1
        ws = Workspace(M, k, H, Fd, E, "cpu")
        ws.h.fill_(float("nan"))
        ws.acc.fill_(float("nan"))
        if split13 > 1:
            ws.split_buffers(split13).fill_(float("nan"))
        deq = M == 3
        cfg = KernelConfig(16, 128, 4, 3, 128, 1, 4, 3, asm=False, deq=deq, deq2=False, split13=split13)
        got = moe_triton(x, ids, wts, tab, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, tab, pool, lay, out_dtype=torch.float32)
        err = _rel(got, ref)
        assert err < (2e-2 if deq else 1e-2), (M, err)
        if split13 > 1:
            ws1 = Workspace(M, k, H, Fd, E, "cpu")
            K.launch_route(ws1, ids)
            K.launch_w13(ws1, x, tab, pool, lay, k, replace(cfg, split13=1))
            assert _h_rel(ws, ws1, M, k, E, ids, tab) < 1e-3, M


@pytest.mark.slow
@needs_interpreter
def test_interpreter_split13_row_chunks_and_repeated_ids():
    """Segments longer than a row block (two chunks), and an expert chosen twice by one row (its
    segment has more rows than M: the reduction steps over a chunk in several row blocks)."""
    from cmoe.executor.kernels_triton import KernelConfig, Workspace, moe_triton
    gen = torch.Generator().manual_seed(21)
    g, H, Fd, E = 128, 256, 128, 2
    lay, pool, table = _pool(E, 3, H, Fd, g, gen, "cpu")
    cases = [(torch.zeros(20, 1, dtype=torch.int32), torch.rand(20, 1, generator=gen)),
             (torch.tensor([[1, 1]], dtype=torch.int32), torch.rand(1, 2, generator=gen))]
    for ids, wts in cases:
        M, k = ids.shape
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
        ws = Workspace(M, k, H, Fd, E, "cpu")
        ws.h.fill_(float("nan"))
        ws.split_buffers(2).fill_(float("nan"))
        cfg = KernelConfig(16, 128, 4, 3, 128, 1, 4, 3, asm=False, deq=False, deq2=False, split13=2)
        got = moe_triton(x, ids, wts, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(got, ref) < 1e-2, ids.shape


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_k_split_cuts_whole_units_and_never_an_empty_split():
    from cmoe.executor.kernels_triton.moe import k_split
    for K in (64, 128, 192, 320, 384, 448, 512, 4096, 14336, 14336 + 64):
        for g in (32, 64, 128, 256):
            if g == 256 and K % 256:
                continue
            U = max(128, g)
            units = K // U
            for want in range(1, 20):
                s, ups = k_split(K, g, want)
                assert 1 <= s <= max(1, min(want, units))
                covered = [min(units, (i + 1) * ups) - i * ups for i in range(s)]
                assert all(c >= 1 for c in covered) or units == 0, (K, g, want)
                assert sum(covered) == units or units == 0
    assert k_split(4096, 128, 8) == (8, 4) and k_split(4096, 128, 3) == (3, 11)
    assert k_split(448, 32, 4) == (3, 1) and k_split(448, 32, 2) == (2, 2)
    assert k_split(64, 32, 4) == (1, 0)


@needs_interpreter
@pytest.mark.parametrize("P", [6, 74, 512])
def test_interpreter_route_kernel_equals_route_into(P):
    """Up to ROUTE_KERNEL_MAX_PAIRS pairs the route kernel runs; past it `route_into`: both write
    the same tables from the same ids (padding ids -1 included)."""
    from cmoe.executor.kernels_triton import moe as K
    from cmoe.executor.moe_kernel import route_into
    assert P <= K.ROUTE_KERNEL_MAX_PAIRS
    gen = torch.Generator().manual_seed(P)
    E = 8
    ids = torch.randint(-1, E, (P // 2, 2), generator=gen, dtype=torch.int32)
    ws = K.Workspace(P // 2, 2, 64, 64, E, "cpu")
    for t in (ws.order, ws.sorted, ws.seg_s, ws.seg_end):
        t.fill_(77)
    ws.acc.fill_(float("nan"))
    K.launch_route(ws, ids)
    o, s, e, st, en = (torch.full_like(t, 77) for t in (ws.order, ws.sorted, ws.seg_e, ws.seg_s, ws.seg_end))
    route_into(ids, o, s, e, st, en)
    for a, b in ((ws.order, o), (ws.sorted, s), (ws.seg_e, e), (ws.seg_s, st), (ws.seg_end, en)):
        assert torch.equal(a, b)
    assert (ws.acc == 0).all()
