"""The Triton layer kernel's ZP branch (`-fp16` formats: fp16 (scale, zero point) pairs, GPTQ and AWQ
as stored) against the plain-torch reference from the same slot bytes, which computes with the
exact weights (q - zp) * s.

In Triton's CPU interpreter (`TRITON_INTERPRET=1` where triton is importable): every group size,
k tails, both ways of applying the affine part (deq and not), split-K of w13, an expert without a
slot. On CUDA (marked `gpu`): the same with the inline-PTX unpacking (asm), which ZP only uses for
the codes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from cmoe.executor.layout import slot_size
from cmoe.executor.moe_kernel import moe_reference, tiled_layout, write_codes

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(not (HAVE_TRITON and INTERPRET),
                                       reason="Triton's interpreter: needs triton and TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs CUDA (and not TRITON_INTERPRET=1)")

# (group, H, F): tails of 64 (g = 32, 64) and 32 (g = 32) in one matrix or the other
SHAPES = [(32, 448, 160), (64, 320, 192), (128, 256, 128), (256, 512, 256)]


def _pool(E: int, S: int, H: int, Fd: int, g: int, gen: torch.Generator, device: str):
    """Random experts in a w4g{g}-fp16 pool: codes, fp16 scales with all 11 mantissa bits, zero
    points 0..16 (16: GPTQ's original layout reads a stored 15 as 16)."""
    lay = tiled_layout(f"w4g{g}-fp16", H, Fd)
    pool = torch.full((S, slot_size(lay)), 0xFF, dtype=torch.uint8, device=device)
    perm = torch.randperm(S, generator=gen, device=device)[:E]
    for e in range(E):
        for name, (n, k) in (("w13", (2 * Fd, H)), ("w2", (H, Fd))):
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen, device=device)
            scale = torch.rand(k // g, n, generator=gen, device=device) * 0.02 + 0.001
            zp = torch.randint(0, 17, (k // g, n), generator=gen, device=device).float()
            write_codes(pool[int(perm[e])], lay, name, codes, torch.stack([scale, zp], -1).to(torch.float16))
    return lay, pool, perm.int()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check(g, H, Fd, device, asm: bool, splits=(1, 2)):
    from cmoe.executor.kernels_triton import KernelConfig, Workspace, moe_triton
    gen = torch.Generator(device=device).manual_seed(g + H)
    E, S, k = 3, 4, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen, device)
    for M in (1, 5):
        x = torch.randn(M, H, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen, device=device)[:k] for _ in range(M)]).int()
        wts = torch.rand(M, k, generator=gen, device=device)
        tab = table.clone()
        if M == 5:                                    # an expert without a slot
            tab[int(ids[0, 0])] = -1
        ref = moe_reference(x, ids, wts, tab, pool, lay, out_dtype=torch.float32)
        for deq in (True, False):
            for split13 in splits:
                ws = Workspace(M, k, H, Fd, E, device)
                ws.h.fill_(float("nan"))
                cfg = KernelConfig(16, 128, 4, 3, 128, 1, 4, 3, asm=asm, deq=deq, deq2=deq, split13=split13)
                got = moe_triton(x, ids, wts, tab, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
                # deq rounds each weight to bf16 once (and the interpreter truncates): looser
                assert _rel(got, ref) < (2e-2 if deq else 1e-2), (M, deq, split13, _rel(got, ref))


@pytest.mark.parametrize("g,H,Fd", SHAPES)
@pytest.mark.slow
@needs_interpreter
def test_interpreter_fp16_pairs_match_the_reference(g, H, Fd):
    _check(g, H, Fd, "cpu", asm=False)


@pytest.mark.parametrize("g,H,Fd", SHAPES)
@pytest.mark.gpu
@needs_cuda
def test_cuda_fp16_pairs_match_the_reference(g, H, Fd):
    for asm in (True, False):
        _check(g, H, Fd, "cuda", asm=asm, splits=(1, 3))


def test_the_reference_reads_fp16_pairs_exactly():
    """moe_reference's weights from a -fp16 slot are (q - zp) * s in fp32, bit for bit (any CPU)."""
    from cmoe.executor.kernels import dequantize
    from cmoe.executor.moe_kernel import dequantized, read_expert
    gen = torch.Generator().manual_seed(0)
    lay, pool, table = _pool(2, 2, 256, 128, 64, gen, "cpu")
    w13, w2 = dequantized(pool[int(table[0])], lay)
    p = read_expert(pool[int(table[0])], lay)
    s, zp = p["w13_sz"].float().unbind(-1)                               # [K/g, N]
    want = (p["w13"].float().reshape(256, 4, 64) - zp.T[..., None]) * s.T[..., None]
    assert p["w13_sz"].dtype == torch.float16
    assert torch.equal(w13, want.reshape(256, 256)) and torch.equal(w2, dequantize(p["w2"], p["w2_sz"], 64))
