"""The C functions the compiled host program calls (`cmoe.executor.host_program`), by address.

The program once closed over ctypes function objects, which numba fixes into the machine code as
constants: a program could not be cached (its addresses differ in every process), so each process
compiled it again, 18-32 s of its first request (BENCHMARKS.md). Here the addresses travel in the
program's inputs (`Prog.fn`, from `runtime_addresses` or the tests' logging stand-ins), and each
call is an indirect call through one of them (`_c1` .. `_c5`: LLVM's inttoptr and call, arguments
cast to the C widths), so the program's code is the same in every process and numba's cache keeps
it (`cache=True`).

The functions: the CUDA runtime's cudaGraphLaunch(exec, stream), cudaEventRecord(event, stream),
cudaStreamWaitEvent(stream, event, flags), cudaEventSynchronize(event), cudaMemcpyAsync(dst, src,
bytes, kind, stream), and libc's clock_gettime(clock, timespec*); each returns an int (0: done).
Last, the engine's own `cpu(layer, phase)`, a ctypes callback into Python: a CPU-expert policy's
layer hands its CPU work back to the engine there (`lean_steps.HostSteps._cpu_step`); 0 where
the policy computes no expert on the CPU (the program then never calls it).
"""

from __future__ import annotations

import cmoe.sim.replay  # noqa: F401,E402  (first: it sets numba's cache folder, `cmoe.sim.replay`)

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# Prog.fn: the functions' addresses
F_LAUNCH, F_RECORD, F_WAIT, F_SYNC, F_COPY, F_CLOCK, F_CPU = range(7)
CLOCK_MONOTONIC = 1


def _codegen(widths: tuple):
    """An indirect call of an int(...) C function whose arguments are `widths` bits wide."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(w) for w in widths])
        ptr = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), fnty.as_pointer())
        vals = []
        for v, t, w in zip(args[1:], sig.args[1:], widths):
            v = context.cast(builder, v, t, types.int64)
            vals.append(v if w == 64 else builder.trunc(v, ir.IntType(w)))
        return builder.call(ptr, vals)
    return codegen


def _ints(*ts) -> bool:
    return all(isinstance(t, types.Integer) for t in ts)


@intrinsic
def _c1(_typingctx, fn, a):
    if _ints(fn, a):
        return types.int32(fn, a), _codegen((64,))


@intrinsic
def _c2(_typingctx, fn, a, b):
    if _ints(fn, a, b):
        return types.int32(fn, a, b), _codegen((64, 64))


@intrinsic
def _c2w(_typingctx, fn, a, b):                          # clock_gettime(int, timespec*)
    if _ints(fn, a, b):
        return types.int32(fn, a, b), _codegen((32, 64))


@intrinsic
def _c3(_typingctx, fn, a, b, c):                        # cudaStreamWaitEvent(stream, event, unsigned flags)
    if _ints(fn, a, b, c):
        return types.int32(fn, a, b, c), _codegen((64, 64, 32))


@intrinsic
def _c5(_typingctx, fn, a, b, c, d, e):                  # cudaMemcpyAsync(dst, src, size_t, int kind, stream)
    if _ints(fn, a, b, c, d, e):
        return types.int32(fn, a, b, c, d, e), _codegen((64, 64, 64, 32, 64))


@njit(cache=True, _nrt=False)
def launch(prog, g, stream):
    return _c2(prog.fn[F_LAUNCH], g, stream)


@njit(cache=True, _nrt=False)
def record(prog, ev, stream):
    return _c2(prog.fn[F_RECORD], ev, stream)


@njit(cache=True, _nrt=False)
def wait(prog, stream, ev, flags):
    return _c3(prog.fn[F_WAIT], stream, ev, flags)


@njit(cache=True, _nrt=False)
def sync(prog, ev):
    return _c1(prog.fn[F_SYNC], ev)


@njit(cache=True, _nrt=False)
def copy(prog, dst, src, n, kind, stream):
    return _c5(prog.fn[F_COPY], dst, src, n, kind, stream)


@njit(cache=True, _nrt=False)
def clock(prog, ts):
    """CLOCK_MONOTONIC (what time.perf_counter reads) into ts [seconds, nanoseconds]."""
    return _c2w(prog.fn[F_CLOCK], CLOCK_MONOTONIC, ts.ctypes.data)


@njit(cache=True, _nrt=False)
def cpu(prog, m, phase):
    """The engine's CPU work for layer m: phase 0 (its input to the host, before the launches),
    phase 1 (the CPU experts summed into the waves' sum, after them)."""
    return _c2(prog.fn[F_CPU], m, phase)


def address(f) -> int:
    return int(ctypes.cast(f, ctypes.c_void_p).value)


def cpu_callback(fn):
    """`fn(layer, phase) -> int` as the C function `Prog.fn[F_CPU]` calls (keep it while it may be)."""
    return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64)(fn)


def runtime_addresses(lib, cpu_step: int = 0) -> np.ndarray:
    """Prog.fn for the CUDA runtime torch loaded (`cuda_rt.Runtime`'s library), libc's clock and the
    engine's CPU step (its callback's address; 0: none)."""
    libc = ctypes.CDLL(None)
    return np.array([address(lib.cudaGraphLaunch), address(lib.cudaEventRecord), address(lib.cudaStreamWaitEvent),
                     address(lib.cudaEventSynchronize), address(lib.cudaMemcpyAsync), address(libc.clock_gettime),
                     cpu_step], np.int64)
