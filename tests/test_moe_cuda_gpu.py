"""The CUDA C++ expert kernel (`cmoe.executor.kernels_cuda`) against the plain-torch reference.

On CUDA (marked `gpu`): every group size, bf16 (scale, zero) and fp16 (scale, zero point) pairs,
one and several row chunks of 8, warps 1-8 a CTA, w2 tiles 1-4 and split-K over CTAs that does and
does not divide the units, w2 as a programmatic dependent launch of w13 (bit for bit the plain
launch's, eager and in a graph), an expert without a slot and padding ids, bf16 routing weights, the
Triton kernel's h for the same rows, CUDA-graph replays on new inputs, and shapes with a k tail
(which the CUDA kernel does not take: the Triton kernel runs them). On the CPU: which shapes the
CUDA kernel takes, the fallback without NVRTC, and that its source compiles for sm_90 in the
macro combinations the host asks for (NVRTC's wheel is in the test extras on Linux, so CI compiles
it; skipped where it is missing).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import replace

import pytest
import torch

from cmoe.executor.layout import slot_size
from cmoe.executor.moe_kernel import moe_forward, moe_reference, route_reference, tiled_layout
from tests.test_moe_kernel_fp16 import _pool as _pool_fp16
from tests.test_moe_kernel_gpu import _inputs, _rel
from tests.test_moe_kernel_gpu import _pool as _pool_bf16

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs CUDA (and not TRITON_INTERPRET=1)")

# (group, H, F), K % 128 == 0 in both matrices
SHAPES = [(32, 512, 384), (64, 256, 512), (128, 512, 384), (256, 512, 768), (128, 1024, 256), (128, 256, 640)]


def _pool(E, S, H, Fd, g, gen, zp: bool):
    """The Triton kernel tests' random pools: bf16 (scale, zero) pairs, or with zp fp16 (scale,
    zero point) pairs."""
    return (_pool_fp16 if zp else _pool_bf16)(E, S, H, Fd, g, gen, "cuda")


def _assert_cuda_ran(g: int, c: dict) -> None:
    """The CUDA kernels of configuration c were compiled (not left to the Triton kernel)."""
    from cmoe.executor.kernels_cuda import moe as C
    assert C.available()
    got = {(k[1], k[2], k[3]) for k, v in C._KERNELS.items() if v is not None and k[2] == g}
    assert (True, g, c["cu13"]) in got and (False, g, c["cu2"]) in got, (g, c, got)


def _nan_workspace(M, k, H, Fd, E):
    """A workspace whose h and acc start as NaN, so a value read before it is written shows."""
    from cmoe.executor.kernels_triton import Workspace
    ws = Workspace(M, k, H, Fd, E, "cuda")
    ws.h.fill_(float("nan"))
    ws.acc.fill_(float("nan"))
    return ws


CUDA_CFGS = [dict(cu13=4, cu2=4, cut2=2, cus2=4), dict(cu13=1, cu2=1, cut2=1, cus2=1),
             dict(cu13=2, cu2=8, cut2=4, cus2=3), dict(cu13=8, cu2=2, cut2=2, cus2=7),
             dict(cu13=4, cu2=4, cut2=2, cus2=4, cux13=True, cux2=False),
             dict(cu13=2, cu2=4, cut2=1, cus2=3, cux13=False, cux2=False), dict(cu13=1, cu2=1, cut2=4, cus2=5, cux13=True),
             dict(cu13=4, cu2=4, cut2=4, cus2=4, cux13=True, cux2=True, cupdl=True),
             dict(cu13=1, cu2=2, cut2=2, cus2=3, cux13=False, cux2=False, cupdl=True)]


@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("g,H,Fd", SHAPES)
@pytest.mark.gpu
@needs_cuda
def test_cuda_layer_matches_the_reference_and_the_triton_h(g, H, Fd, zp):
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(g + H + zp)
    E, S, k = 8, 11, 2
    lay, pool, table = _pool(E, S, H, Fd, g, gen, zp)
    for M in (1, 3, 8, 16, 37):
        x, ids, wts = _inputs(M, k, E, H, gen)
        if M == 16:
            table_m = table.clone()
            table_m[int(ids[0, 0])] = -1                 # an expert without a slot
            ids[1, 1] = -1                                # a padding id
        else:
            table_m = table
        ref = moe_reference(x, ids, wts, table_m, pool, lay, out_dtype=torch.float32)
        tri = Workspace(M, k, H, Fd, E, "cuda")
        base = replace(pick_config(M, triton_only=True), deq=False, deq2=False)
        moe_forward(x, ids, wts, table_m, pool, lay, workspace=tri, config=base, out_dtype=torch.float32)
        for c in CUDA_CFGS:
            ws = _nan_workspace(M, k, H, Fd, E)
            got = moe_forward(x, ids, wts, table_m, pool, lay, workspace=ws, config=replace(base, **c),
                              out_dtype=torch.float32)
            assert _rel(got, ref) < 5e-3, (M, c, _rel(got, ref))
            _assert_cuda_ran(g, c)
            srt = ids.reshape(-1)[route_reference(ids, E)["order"].long()].tolist()
            rows = [p for p, e in enumerate(srt) if 0 <= e < E and int(table_m[e]) >= 0]
            idx = torch.tensor(rows, dtype=torch.long, device="cuda")
            assert _rel(ws.h.index_select(0, idx), tri.h.index_select(0, idx)) < 1e-2, (M, c)


@pytest.mark.gpu
@needs_cuda
def test_bf16_weights_tails_to_triton_and_graph_replays():
    from cmoe.executor.kernels_cuda import moe as C
    from cmoe.executor.kernels_triton import Workspace, pick_config
    gen = torch.Generator(device="cuda").manual_seed(3)
    cfg = replace(pick_config(4), **CUDA_CFGS[0])
    # a k tail (F % 128 = 64): the CUDA kernel does not take it, the Triton kernel runs, still right
    lay, pool, table = _pool(4, 5, 256, 320, 64, gen, False)
    x, ids, wts = _inputs(4, 2, 4, 256, gen)
    assert not C.fits(lay, x, pool, 2)
    got = moe_forward(x, ids, wts, table, pool, lay, config=cfg, out_dtype=torch.float32)
    assert _rel(got, moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)) < 1e-2
    # bf16 routing weights, then a CUDA graph replayed on new inputs and moved experts
    g, H, Fd, E, M, k = 128, 512, 384, 8, 4, 2
    lay, pool, table = _pool(E, E, H, Fd, g, gen, False)
    x, ids, wts = _inputs(M, k, E, H, gen)
    wb = wts.to(torch.bfloat16)
    ws = Workspace(M, k, H, Fd, E, "cuda")
    got = moe_forward(x, ids, wb, table, pool, lay, workspace=ws, config=cfg, out_dtype=torch.float32)
    assert _rel(got, moe_reference(x, ids, wb.float(), table, pool, lay, out_dtype=torch.float32)) < 5e-3
    moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)    # compile (fp32 weights) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=cfg)
    for _ in range(3):
        x2, ids2, wts2 = _inputs(M, k, E, H, gen)
        x.copy_(x2)
        ids.copy_(ids2)
        wts.copy_(wts2)
        table.copy_(table[torch.randperm(E, generator=gen, device="cuda")])
        graph.replay()
        ref = moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)
        assert _rel(out.float(), ref) < 1e-2


@pytest.mark.parametrize("g,xpf,cu13", [(128, True, 4), (256, True, 4), (64, False, 4), (128, True, 0)])
@pytest.mark.gpu
@needs_cuda
def test_w2_as_a_dependent_launch_matches_the_plain_one_bit_for_bit_eager_and_in_a_graph(g, xpf, cu13, monkeypatch):
    """cupdl: w2 launched as a programmatic dependent of w13 (its first two units' weights load
    before it waits for w13) gives the plain launch's bits; with top-1 and no split over CTAs each
    output element gets one atomic add, and h and acc start as NaN, so any h read before w13 wrote
    it would show. 2048 / 128-k units over 4 warps: the preloaded second unit is used. Also inside a
    replayed graph (the capture keeps the programmatic edge). cu13 = 0: after the Triton w13, which
    never triggers early, so w2 starts when it ends and still waits."""
    from cmoe.executor.kernels_cuda import moe as C
    from cmoe.executor.kernels_triton import pick_config
    if not C.pdl_ok(0):
        pytest.skip("needs sm_90+ and cuLaunchKernelEx")
    dependent = []
    real = C._launch_dependent
    monkeypatch.setattr(C, "_launch_dependent", lambda *a: (dependent.append(a[1]), real(*a)))
    gen = torch.Generator(device="cuda").manual_seed(13 + g)
    H, Fd, E, M, k = 1024, 2048, 8, 5, 1
    lay, pool, table = _pool(E, E, H, Fd, g, gen, False)
    x, ids, wts = _inputs(M, k, E, H, gen)
    plain = replace(pick_config(M), cu13=cu13, cu2=4, cut2=2, cus2=1, cux13=xpf, cux2=xpf, cupdl=False)
    dep = replace(plain, cupdl=True)

    ref = moe_forward(x, ids, wts, table, pool, lay, workspace=_nan_workspace(M, k, H, Fd, E), config=plain, out_dtype=torch.float32).clone()
    assert not dependent
    ws = _nan_workspace(M, k, H, Fd, E)
    got = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=dep, out_dtype=torch.float32)
    assert len(dependent) == 1 and dependent[0][0] == H // 32 and dependent[0][2] == 1   # w2, by cuLaunchKernelEx
    assert torch.equal(got, ref)
    assert _rel(got, moe_reference(x, ids, wts, table, pool, lay, out_dtype=torch.float32)) < 5e-3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, ids, wts, table, pool, lay, workspace=ws, config=dep, out_dtype=torch.float32)
    for _ in range(3):
        x.copy_(torch.randn(M, H, generator=gen, device="cuda").to(x.dtype))
        table.copy_(table[torch.randperm(E, generator=gen, device="cuda")])
        ws.h.fill_(float("nan"))
        graph.replay()
        want = moe_forward(x, ids, wts, table, pool, lay, workspace=_nan_workspace(M, k, H, Fd, E), config=plain, out_dtype=torch.float32)
        assert torch.equal(out, want)


# --- CPU -----------------------------------------------------------------------------------------------

def test_without_nvrtc_the_triton_kernel_runs_and_a_warning_says_so(monkeypatch):
    import torch.cuda._utils as U
    if not (hasattr(U, "_get_gpu_rtc_library") and hasattr(torch.cuda, "_compile_kernel")):
        pytest.skip("this torch has no NVRTC wrapper (2.8+)")

    from cmoe.executor.kernels_cuda import moe as C

    def missing():
        raise OSError("libnvrtc.so: cannot open shared object file")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(U, "_get_gpu_rtc_library", missing)
    C.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="NVRTC is not usable .*libnvrtc.so.*Triton kernel"):
            assert C.available() is False
    finally:
        C.available.cache_clear()


def test_a_kernel_that_does_not_compile_is_none_once_with_a_warning(monkeypatch):
    import contextlib

    from cmoe.executor.kernels_cuda import moe as C
    calls = []

    def fail(src, name, **kw):
        calls.append(name)
        raise RuntimeError("nvrtc: error: identifier \"x\" is undefined\nmore log")
    monkeypatch.setattr(torch.cuda, "_compile_kernel", fail, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    key = (0, True, 128, 4, 1, False, False, True)
    monkeypatch.setattr(C, "_KERNELS", {})
    with pytest.warns(UserWarning, match=r"did not compile \(RuntimeError: nvrtc: error: identifier .* undefined\)"):
        assert C.kernel(*key) is None
    assert C.kernel(*key) is None and calls == ["moe_mma"]          # cached: no second compile


def test_the_dependent_launch_structs_have_cuda_h_layout():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on a
    64-bit host: seven uints, the stream at 32, the attributes at 40, their count at 48; an
    attribute is its id, padding to 8 and a 64-byte value, whose first int is the flag."""
    from cmoe.executor.kernels_cuda.moe import _PROGRAMMATIC_STREAM_SERIALIZATION, _Attr, _LaunchConfig
    assert ctypes.sizeof(_Attr) == 72 and _Attr.value.offset == 8
    assert (_LaunchConfig.shared.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.n_attrs.offset) == (24, 32, 40, 48)
    a = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    a.value[0] = 1
    assert bytes(a)[:12] == bytes([6, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]) and not any(bytes(a)[12:])


def test_fits_takes_whole_blocks_aligned_bf16_rows_and_slots_only():
    from cmoe.executor.kernels_cuda.moe import fits
    lay = tiled_layout("w4g128", 4096, 14336)
    x = torch.zeros(3, 4096, dtype=torch.bfloat16)
    pool = torch.zeros(2, slot_size(lay), dtype=torch.uint8)
    assert fits(lay, x, pool) and fits(lay, x, pool, 8)
    assert fits(tiled_layout("w4g32-fp16", 2048, 1408), x[:, :2048], pool)
    assert not fits(tiled_layout("w4g64", 256, 320), x, pool)              # F % 128 = 64
    assert not fits(tiled_layout("w4g32", 448, 256), x, pool)              # H % 128 = 64
    assert not fits(tiled_layout("w4g128", 384, 512), x, pool, 16)         # H % (16 tiles) != 0
    assert not fits(lay, x.float(), pool)                                  # not bf16
    assert not fits(lay, torch.zeros(3, 4098, dtype=torch.bfloat16)[:, :4096], pool)   # rows not 8-byte aligned
    assert not fits(lay, x.reshape(-1)[1:4097].reshape(1, 4096), pool)     # start not 8-byte aligned
    assert not fits(lay, x, pool.reshape(-1)[8:8 + slot_size(lay)].reshape(1, -1))      # slot not 16-byte aligned


def _nvrtc():
    pats = [os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.*") for p in sys.path if p]
    libs = sorted(f for p in pats for f in glob.glob(p)
                  if "builtins" not in os.path.basename(f) and ".alt." not in os.path.basename(f))
    if not libs:
        return None
    try:
        # its builtins library first (NVRTC dlopens it by name, which finds a loaded one)
        for b in glob.glob(os.path.join(os.path.dirname(libs[-1]), "libnvrtc-builtins.so.*")):
            if ".alt." not in os.path.basename(b):
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(libs[-1])
    except OSError:
        return None


@pytest.mark.parametrize("w13,g,warps,tiles,zp,wbf,opt,pdl", [
    (True, 32, 4, 1, False, False, True, False), (True, 256, 8, 1, True, False, False, False),
    (False, 64, 4, 2, False, True, False, False), (False, 128, 1, 4, True, False, True, False),
    (False, 256, 2, 1, False, False, False, False), (True, 128, 4, 1, False, False, True, True),
    (False, 128, 4, 4, False, False, True, True), (False, 256, 2, 2, True, True, False, True)])
def test_the_cuda_source_compiles_for_sm90(w13, g, warps, tiles, zp, wbf, opt, pdl):
    """NVRTC (the nvidia-cuda-nvrtc wheel, where installed) compiles the source for sm_90 with the
    macros the host sets: a syntax or asm-constraint error is caught without a GPU."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    from cmoe.executor.kernels_cuda.moe import defines, source
    prog = ctypes.c_void_p()
    src = (defines(w13, g, warps, tiles, zp, wbf, opt, pdl) + source()).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"moe_mma.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    assert n.value > 0
