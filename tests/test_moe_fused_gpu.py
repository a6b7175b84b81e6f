"""The fused expert launch (`moe_fused`: w13 and w2 of a layer in one CUDA launch, issue 14) against
the plain-torch reference and the two-launch CUDA path.

On CUDA (marked `gpu`): every group size, bf16 and fp16 pairs, 1-37 rows (one and several row
chunks), warps 8 and 16 a CTA (one or two warps on a gate/up tile pair; 32, which the launch refuses, runs
the two launches), w2 steps of 1, 2 and 4
tiles, x and h loaded with the unit or when computed, bf16 routing weights, an expert without a
slot and padding ids; h bit for bit the two-launch w13's with as many warps on a tile pair (same
units a warp, same order of the warps' sums), no w13 or w2 launch, and CUDA-graph replays on new
inputs and moved experts. On the CPU: which layouts the fused launch takes and that its source
compiles for sm_90 (NVRTC's wheel, as `test_moe_cuda_gpu` compiles the two-launch kernel).
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from cmoe.executor.moe_kernel import moe_forward, moe_reference, route_reference, tiled_layout
from tests.test_moe_cuda_gpu import SHAPES, _nan_workspace, _nvrtc, _pool, graph_replays_follow, needs_cuda
from tests.test_moe_kernel_gpu import _inputs, _rel

# (cufuse warps, cut2 tiles, cux13, cufx2)
FUSED = [(8, 2, True, False), (16, 1, False, True), (16, 4, True, True), (32, 2, False, False)]


def _h_rows(ids, table, E: int) -> torch.Tensor:
    """The rows of h the kernels write: pairs (in sorted order) of an expert with a slot."""
    srt = ids.reshape(-1)[route_reference(ids, E)["order"].long()].tolist()
    return torch.tensor([p for p, e in enumerate(srt) if 0 <= e < E and int(table[e]) >= 0],
                        dtype=torch.long, device="cuda")


@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("g,H,Fd", SHAPES)
@pytest.mark.gpu
@needs_cuda
def test_fused_matches_the_reference_and_the_two_launch_h_bit_for_bit(g, H, Fd, zp, monkeypatch):
    from cmoe.executor.kernels_cuda import moe as C
    from cmoe.executor.kernels_triton import pick_config
    apart = []
    for name in ("launch_w13", "launch_w2"):
        real = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, _r=real, _n=name, **kw: (apart.append(_n), _r(*a, **kw))[1])
    gen = torch.Generator(device="cuda").manual_seed(g + H + zp)
    E, S, k = 8, 11, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen, zp)
    U = max(128, g)
    for M in (1, 3, 8, 16, 37):
        x, ids, wts = _inputs(M, k, E, H, gen)
        if M == 16:
            table_m = table.clone()
            table_m[int(ids[0, 0])] = -1                 # an expert without a slot
            ids[1, 1] = -1                                # a padding id
        else:
            table_m = table
        ref = moe_reference(x, ids, wts, table_m, pool, lay, out_dtype=torch.float32)
        rows = _h_rows(ids, table_m, E)
        for warps, tiles, xpf, xpf2 in FUSED:
            cfg = replace(pick_config(M), cufuse=warps, cut2=tiles, cux13=xpf, cufx2=xpf2, cupdl=False)
            takes = C.fused_fits(lay, warps, tiles)
            apart.clear()
            ws = _nan_workspace(M, k, H, Fd, E)
            got = moe_forward(x, ids, wts, table_m, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
            assert _rel(got, ref) < 5e-3, (M, warps, tiles, _rel(got, ref))
            assert apart == ([] if takes else ["launch_w13", "launch_w2"]), (M, warps, tiles, apart)
            if not takes:
                continue
            assert (0, False, g, warps, tiles, zp, False, xpf, False, True, xpf2) in C._KERNELS
            # the two-launch w13 with KS = warps / (U / 16) warps a CTA: the same sums in the same order
            two = _nan_workspace(M, k, H, Fd, E)
            moe_forward(x, ids, wts, table_m, pool, lay, workspace=two, out_dtype=torch.float32,
                        config=replace(cfg, cufuse=0, cu13=warps // (U // 16), cu2=4, cut2=2, cus2=4))
            assert torch.equal(ws.h.index_select(0, rows), two.h.index_select(0, rows)), (M, warps, tiles)


@pytest.mark.gpu
@needs_cuda
def test_fused_with_bf16_weights_and_in_a_replayed_graph():
    from cmoe.executor.kernels_cuda import moe as C
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(14)
    g, H, Fd, E, M, k = 128, 512, 384, 8, 4, 2
    lay, pool, table = _pool(E, E, H, Fd, g, gen, False)
    cfg = replace(pick_config(M), cufuse=8, cut2=2, cux13=True, cufx2=False)
    assert C.fused_fits(lay, 8, 2)
    x, ids, wts = _inputs(M, k, E, H, gen)
    wb = wts.to(torch.bfloat16)
    ws = Workspace(M, k, H, Fd, E, "cuda")
    got = moe_forward(x, ids, wb, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
    assert _rel(got, moe_reference(x, ids, wb.float(), table, pool, lay, out_dtype=torch.float32)) < 5e-3
    assert (0, False, g, 8, 2, False, True, True, False, True, False) in C._KERNELS
    graph_replays_follow(x, ids, wts, table, pool, lay, ws, cfg, gen)


# --- CPU -----------------------------------------------------------------------------------------------

def test_fused_fits_takes_whole_units_and_tile_pairs_shared_evenly():
    from cmoe.executor.kernels_cuda.moe import fused_fits
    lay = tiled_layout("w4g128", 4096, 14336)
    assert fused_fits(lay, 8, 2) and fused_fits(lay, 16, 4) and fused_fits(lay, 16, 1)
    assert not fused_fits(lay, 4, 2)                         # 8 tile pairs a CTA on 4 warps
    assert not fused_fits(lay, 12, 2)                        # 8 pairs do not share 12 warps evenly
    assert not fused_fits(lay, 32, 2)                        # more than 16 warps (128 registers a thread)
    assert not fused_fits(lay, 0, 2)
    g256 = tiled_layout("w4g256", 4096, 14336)
    assert fused_fits(g256, 16, 2) and not fused_fits(g256, 8, 2)   # U = 256: 16 tile pairs
    assert not fused_fits(tiled_layout("w4g32", 4096 + 64, 14336), 8, 2)    # H % 128 = 64: a part unit


@pytest.mark.parametrize("g,warps,tiles,zp,wbf,xpf,xpf2", [
    (128, 8, 2, False, False, True, False), (128, 16, 4, False, False, True, True),
    (32, 8, 1, True, True, False, False), (64, 16, 2, False, False, True, True),
    (256, 16, 1, True, False, False, False)])
def test_the_fused_source_compiles_for_sm90(g, warps, tiles, zp, wbf, xpf, xpf2):
    lib = _nvrtc()
    if lib is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    from cmoe.executor.kernels_cuda.moe import defines, source
    src = defines(False, g, warps, tiles, zp, wbf, xpf, False, True, xpf2) + source()
    assert "#define FUSED 1" in src and f"#define MINB {max(1, 16 // warps)}" in src
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"moe_mma.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    assert b"moe_fused" in cubin.raw and b"moe_mma" not in cubin.raw
