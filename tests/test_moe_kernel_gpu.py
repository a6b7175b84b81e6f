"""The Triton MoE-layer kernels on CUDA (marked `gpu`, skipped without it) against the plain-torch
reference computed from the same slot bytes: every group size, several batch sizes (one row
chunk and several), k tails, both unpacking paths, experts without a slot, padding ids, and a
CUDA-graph replay on new inputs."""

from __future__ import annotations

import pytest
import torch

from cmoe.executor.layout import slot_size
from cmoe.executor.moe_kernel import moe_forward, moe_reference, route_reference, tiled_layout, write_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (group, H, F): the last two of g=32/64 have K % 128 != 0 in one matrix or both (the tail regions)
SHAPES = [(32, 512, 384), (32, 192, 160), (64, 256, 512), (64, 192, 320), (128, 512, 384), (256, 512, 768)]


def _pool(E: int, S: int, H: int, Fd: int, g: int, gen: torch.Generator):
    lay = tiled_layout(f"w4g{g}", H, Fd)
    pool = torch.full((S, slot_size(lay)), 0xFF, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(S, generator=gen, device="cuda")[:E]
    for e in range(E):
        for name, (n, k) in (("w13", (2 * Fd, H)), ("w2", (H, Fd))):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen, device="cuda")
            sz = torch.stack([torch.rand(k // g, n, generator=gen, device="cuda") * 0.02 + 0.001,
                              (torch.rand(k // g, n, generator=gen, device="cuda") - 0.5) * 0.1], -1)
            write_codes(pool[int(perm[e])], lay, name, codes, sz.to(torch.bfloat16))
    return lay, pool, perm.int()


def _inputs(M: int, k: int, E: int, H: int, gen: torch.Generator):
    x = torch.randn(M, H, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:k] for _ in range(M)]).int()
    wts = torch.rand(M, k, generator=gen, device="cuda")
    return x, ids, wts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("g,H,Fd,asm,deq", [(*s, True, d) for s in SHAPES for d in (True, False)]
                         + [(*SHAPES[1], False, True), (*SHAPES[4], False, False)])
def test_triton_layer_matches_the_reference(g, H, Fd, asm, deq):
    """deq: weights dequantized to bf16 in registers (a bf16 rounding each, as torch's tinygemm does);
    else the group's affine part applied in fp32 to exact dots of the codes."""
    from dataclasses import replace

    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(g * 7 + H + asm)
    E, S, k = 8, 11, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    for M in (1, 3, 16, 37, 64):
        x, ids, wts = _inputs(M, k, E, H, gen)
        ws = Workspace(M, k, H, Fd, E, "cuda")
        ws.h.fill_(float("nan"))
        ws.acc.fill_(float("nan"))
        cfg = replace(pick_config(M), asm=asm, deq=deq, deq2=deq)
        got = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        err = _rel(got, ref)
        assert err < (1e-2 if deq else 5e-3), (M, err)
        r = route_reference(ids, E)
        assert torch.equal(ws.order, r["order"])
        n = r["seg_expert"].numel()
        assert torch.equal(ws.seg_e[:n], r["seg_expert"]) and bool((ws.seg_e[n:] == -1).all())


def test_row_chunks_split_k_and_skipped_experts():
    """More rows per expert than a CTA's row block (several chunks), a split the units do not
    divide, an expert whose slot is -1 and padding ids -1: all as the reference."""
    from cmoe.executor.kernels_triton import KernelConfig
    gen = torch.Generator(device="cuda").manual_seed(5)
    g, H, Fd, E, S, k, M = 64, 256, 640, 4, 6, 2, 50
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    x, ids, wts = _inputs(M, k, E, H, gen)
    table[int(ids[0, 0])] = -1
    ids[3, 1] = -1
    for cfg in (KernelConfig(16, 32, 4, 2, 64, 3, 4, 2, deq=False, deq2=False),
                KernelConfig(16, 32, 1, 4, 32, 3, 1, 4),
                KernelConfig(16, 32, 2, 3, 64, 7, 1, 3, deq=False, deq2=False),
                KernelConfig(32, 64, 4, 3, 32, 7, 4, 3, asm=False)):
        got = moe_forward(x, ids, wts, table, pool, lay, config=cfg, out_dtype=torch.float32)
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(got, ref) < (5e-3 if not cfg.deq else 1e-2)


def test_cuda_graph_replays_on_new_inputs():
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(9)
    g, H, Fd, E, S, k, M = 128, 512, 384, 8, 8, 2, 4
    lay, pool, table = _pool(E, S, H, Fd, g, gen)
    x, ids, wts = _inputs(M, k, E, H, gen)
    ws = Workspace(M, k, H, Fd, E, "cuda")
    cfg = pick_config(M)
    moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)
    for _ in range(3):
        x2, ids2, wts2 = _inputs(M, k, E, H, gen)
        x.copy_(x2)
        ids.copy_(ids2)
        wts.copy_(wts2)
        table.copy_(table[torch.randperm(E, generator=gen, device="cuda")])  # experts moved between slots
        graph.replay()
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(out.float(), ref) < 1e-2      # bf16 output
