"""The expert matmuls in CUDA C++ (`moe_mma.cu`, which says how and why), compiled at first use by
NVRTC through `torch.cuda._compile_kernel`, launched in place of the Triton `_expert_mm` by
`kernels_triton.moe.launch_w13` / `launch_w2` when a `KernelConfig` names warps for them (cu13,
cu2) and the tensors allow it (`fits`). Route, workspace, h and acc are the Triton path's, so the
two mix per launch and the CUDA-graph rules are the same (the launch goes to the current stream;
compile outside a capture, as a warm-up call does).

NVRTC comes with PyTorch's CUDA wheels; torch's wrapper also asks for the CUDA toolkit's include
path (CUDA_HOME), though the source includes no header. Where either is missing or a compile
fails, a warning says so once and the Triton kernel runs those launches: slower, never wrong (a
device older than sm_80, which has no bf16 mma, uses the Triton kernel without a warning). One binary per (role, group, warps, tiles, zero-point format,
weight dtype, x loading, dependent launch, device), compiled once per process (~1 s each).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from importlib import resources

import torch

BM = 8                      # rows of a segment a CTA (the mma's n)


@functools.cache
def source() -> str:
    return resources.files(__package__).joinpath("moe_mma.cu").read_text()


@functools.cache
def available(device: int = 0) -> bool:
    """CUDA on an sm_80+ device, torch's NVRTC wrapper and the NVRTC library it loads (ROCm never:
    the source is PTX-level CUDA). Without them the Triton kernel runs every matmul; a missing
    NVRTC library gets a warning."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_compile_kernel") or torch.version.hip:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        from torch.cuda._utils import _get_gpu_rtc_library
    except ImportError:
        return True                                    # this torch finds NVRTC its own way
    try:
        _get_gpu_rtc_library()
    except Exception as e:                                               # noqa: BLE001
        warnings.warn(f"cmoe: NVRTC is not usable ({e}); the expert matmuls run on the Triton kernel")
        return False
    return True


def defines(is_w13: bool, group: int, warps: int, tiles: int, zp: bool, wt_bf16: bool, xpf: bool = True,
            pdl: bool = False) -> str:
    vals = dict(IS_W13=int(is_w13), G=group, NW=warps, MT=tiles, ZP=int(zp), WT_BF16=int(wt_bf16), XPF=int(xpf),
                PDL=int(pdl))
    return "".join(f"#define {k} {v}\n" for k, v in vals.items())


_KERNELS: dict[tuple, object] = {}


def kernel(device: int, *macros):
    """The compiled kernel for these `defines` on this device, or None where it did not compile
    (a warning, once per binary; the caller runs the Triton kernel instead)."""
    key = (device, *macros)
    if key not in _KERNELS:
        try:
            with torch.cuda.device(device):
                _KERNELS[key] = torch.cuda._compile_kernel(defines(*macros) + source(), "moe_mma",
                                                           nvcc_options=["-std=c++17"])
        except Exception as e:                                           # noqa: BLE001
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warnings.warn(f"cmoe: the CUDA expert kernel did not compile ({type(e).__name__}: {first}); "
                          "the Triton kernel runs instead")
            _KERNELS[key] = None
    return _KERNELS[key]


def fits(layout, x: torch.Tensor, pool: torch.Tensor, tiles: int = 1) -> bool:
    """Whether the CUDA kernel can read these: no k tail (K % 128 == 0 in both matrices), whole
    16-row tiles (`tiles` of them a warp, w2's cut2; w13's F % 16 follows from F % 128), bf16
    activations (x or h) with 8-byte aligned rows, and 16-byte aligned slots (its loads are 8 and
    16 bytes wide)."""
    H, Fd = layout.hidden, layout.ffn
    return (H % 128 == 0 and Fd % 128 == 0 and H % (16 * tiles) == 0 and layout.group in (32, 64, 128, 256)
            and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0
            and pool.dtype == torch.uint8 and pool.stride(0) % 16 == 0 and pool.data_ptr() % 16 == 0)


@functools.cache
def pdl_ok(device: int) -> bool:
    """Programmatic dependent launch: sm_90+ and a driver with cuLaunchKernelEx."""
    return torch.cuda.get_device_capability(device) >= (9, 0) and _launch_ex() is not None


@functools.cache
def _launch_ex():
    from torch.cuda._utils import _get_gpu_runtime_library
    return getattr(_get_gpu_runtime_library(), "cuLaunchKernelEx", None)


class _Attr(ctypes.Structure):           # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):   # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _launch_dependent(k, grid, block, args) -> None:
    """k on the current stream as a programmatic dependent of the grid before it (cuLaunchKernelEx
    with programmatic stream serialization; captured into CUDA graphs as a programmatic edge): it may
    start once every CTA of that grid has run `griddepcontrol.launch_dependents`, and must run
    `griddepcontrol.wait` before it reads what that grid writes. Arguments as torch's wrapper takes
    them (tensors as pointers, ints as C ints)."""
    vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0,
                        torch.cuda.current_stream().cuda_stream, ctypes.pointer(attr), 1)
    err = _launch_ex()(ctypes.byref(cfg), ctypes.c_void_p(getattr(k.func, "value", k.func)), ptrs, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


def launch_w13(ws, x, slot_table, pool, layout, topk: int, warps: int, xpf: bool = False, warmup: bool = False,
               pdl: bool = False):
    """gate/up with SiLU into ws.h (rows in sorted order), one launch, K not split across CTAs.
    xpf: x loaded with its unit's weights (XPF in `moe_mma.cu`), else per block when computed;
    pdl: compiled to let the next grid (w2 launched with pdl) start early (sm_90+, else ignored).
    Returns the kernel, or None (nothing launched) where it did not compile."""
    dev = x.device.index or 0
    k = kernel(dev, True, layout.group, warps, 1, bool(layout.zero_point), False, xpf, pdl and pdl_ok(dev))
    if k is None or warmup:
        return k
    M = x.shape[0]
    nch = -(-M // BM)
    units = layout.hidden // max(128, layout.group)
    k(grid=(layout.ffn // 16, ws.A * nch, 1), block=(32 * warps, 1, 1),
      args=[x, x.stride(0), pool, pool.stride(0), slot_table, slot_table.numel(), ws.seg_e, ws.seg_s, ws.seg_end,
            ws.order, ws.order, ws.h, ws.h.stride(0), layout.part("w13").offset, layout.part("w13_sz").offset,
            layout.ffn, layout.hidden, topk, nch, units])
    return k


def launch_w2(ws, topk_weights, slot_table, pool, layout, topk: int, M: int, warps: int, tiles: int,
              ksplit: tuple[int, int], xpf: bool = True, warmup: bool = False, pdl: bool = False):
    """down with the routing weights, atomically added into ws.acc; K split over grid z as
    ksplit = (splits, units a split) says (`kernels_triton.moe.k_split`, which cuts it for both).
    pdl: launched as a programmatic dependent of the launch before it (sm_90+, else a plain launch;
    right after any grid, since it waits for that grid before it reads h; early only after a w13
    compiled with pdl). Returns the kernel, or None (nothing launched) for routing weights neither
    fp32 nor bf16 or a kernel that did not compile."""
    if topk_weights.dtype not in (torch.float32, torch.bfloat16):
        return None
    wt_bf16 = topk_weights.dtype == torch.bfloat16
    dev = ws.h.device.index or 0
    pdl = pdl and pdl_ok(dev)
    k = kernel(dev, False, layout.group, warps, tiles, bool(layout.zero_point), wt_bf16, xpf, pdl)
    if k is None or warmup:
        return k
    nch = -(-M // BM)
    s, ups = ksplit
    grid, block = (layout.hidden // (16 * tiles), ws.A * nch, s), (32 * warps, 1, 1)
    args = [ws.h, ws.h.stride(0), pool, pool.stride(0), slot_table, slot_table.numel(), ws.seg_e, ws.seg_s,
            ws.seg_end, ws.order, topk_weights, ws.acc, ws.acc.stride(0), layout.part("w2").offset,
            layout.part("w2_sz").offset, layout.hidden, layout.ffn, topk, nch, ups]
    if pdl:
        _launch_dependent(k, grid, block, args)
    else:
        k(grid=grid, block=block, args=args)
    return k
