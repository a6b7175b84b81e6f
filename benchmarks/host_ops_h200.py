"""What each CUDA call the lean engine's host step makes costs the host, measured on a GPU (issue 13).

The loading policies' host step takes 100-170 us per MoE layer at batch 1 (BENCHMARKS.md, third
H200 session), against issue 13's 60 us. This times, one by one, every kind of call that step
makes: timing events (new and reused), stream switches, waits, the slot table's small pinned
copy, an expert's 91 MB pinned copy (through torch and through the CUDA runtime directly),
graph replays and the read-back's round trip; then the executor's own runtime calls
(`cmoe.executor.cuda_rt`) as the host step makes them since: a mark on a pooled event, reading
it back, making an event, a query, the small copy and the read-back through the runtime. Each
figure is the median host time of one call over many, in microseconds; the GPU is kept busy
where a call would otherwise find it idle.

    python benchmarks/host_ops_h200.py --out $OUT/host-ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.executor.cuda_rt import D2H, H2D, Runtime  # noqa: E402
from cmoe.executor.streams import Clock  # noqa: E402


def _per_call(fn, n: int, setup=None) -> float:
    """Median host microseconds of fn() over n calls (perf_counter around each)."""
    ts = []
    for _ in range(n):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _cudart():
    """The CUDA runtime torch loaded (the executor's own lookup, `cuda_rt.Runtime`) and its library,
    whose calls `Runtime` bound (the raw ctypes calls are timed); (None, None) where it is not found."""
    rt = Runtime.get()
    return (None, None) if rt is None else (rt._lib, rt.path)


def _executor_calls(r: dict, n: int, dev, cs, keep_busy) -> None:
    """The executor's own runtime calls as its host step makes them (`cuda_rt`, `Clock`): a mark
    on a pooled event, reading it back, making an event, a query, the slot table's small copy,
    and the read-back's round trip."""
    rt = Runtime.get()
    clock = Clock(dev)
    clock.reserve_events(2 * n)
    keep_busy()
    marks = []
    r["Clock.mark, runtime (pooled event)"] = _per_call(lambda: marks.append(clock.mark(cs)), n)
    torch.cuda.synchronize()
    it = iter(marks)
    r["Clock.us, runtime (read once, event back to the pool)"] = _per_call(lambda: clock.us(next(it)), n)
    made = []
    r["cudaEventCreateWithFlags (Runtime.event)"] = _per_call(lambda: made.append(rt.event(0)), n)
    for ev in made:
        rt.destroy(ev)
    ev = clock.order_event()
    rt.record(ev, cs.cuda_stream)
    torch.cuda.synchronize()
    r["cudaEventQuery, done (Runtime.query)"] = _per_call(lambda: rt.query(ev), n)
    th = torch.zeros(8, dtype=torch.int32, pin_memory=True)
    td = torch.zeros(8, dtype=torch.int32, device=dev)
    h, src, dst = cs.cuda_stream, th.data_ptr(), td.data_ptr()
    keep_busy()
    r["small pinned H2D cudaMemcpyAsync (32 B, Runtime.copy)"] = _per_call(lambda: rt.copy(dst, src, 32, H2D, h), n)
    torch.cuda.synchronize()
    rb = torch.zeros(4, 16, device=dev)
    pin = torch.empty((4, 16), pin_memory=True)
    pp, rp, nb = pin.data_ptr(), rb.data_ptr(), pin.nbytes

    def roundtrip():
        rt.copy(pp, rp, nb, D2H, h)
        rt.record(ev, h)
        rt.sync(ev)
    r["read-back round trip, runtime, GPU idle"] = _per_call(roundtrip, 500)
    clock.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    dev = torch.device("cuda")
    cs = torch.cuda.current_stream(dev)
    cp = torch.cuda.Stream(dev)
    n = a.n
    r: dict[str, float] = {}
    busy = torch.empty(1 << 26, device=dev)

    def keep_busy():                                  # ~25 ms of GPU work so nothing finds the GPU idle
        torch.cuda._sleep(50_000_000)

    r["perf_counter"] = _per_call(time.perf_counter, n)
    r["current_stream"] = _per_call(lambda: torch.cuda.current_stream(dev), n)
    r["Event() only"] = _per_call(lambda: torch.cuda.Event(enable_timing=True), n)
    keep_busy()
    r["Event() + record, new (clock.mark)"] = _per_call(lambda: torch.cuda.Event(enable_timing=True).record(cs), n)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for e in evs:
        e.record(cs)
    torch.cuda.synchronize()
    it = iter(evs)
    keep_busy()
    r["record, reused event"] = _per_call(lambda: next(it).record(cs), n)
    ev = torch.cuda.Event()
    ev.record(cs)
    r["record, reused event, no timing"] = _per_call(lambda: ev.record(cs), n)
    torch.cuda.synchronize()
    r["wait_event (done)"] = _per_call(lambda: cs.wait_event(ev), n)
    keep_busy()
    ev.record(cs)
    r["wait_event (pending)"] = _per_call(lambda: cp.wait_event(ev), n)
    torch.cuda.synchronize()
    r["query (done)"] = _per_call(ev.query, n)
    r["synchronize (done)"] = _per_call(ev.synchronize, n)

    def ctx():
        with torch.cuda.stream(cp):
            pass
    r["with torch.cuda.stream(s)"] = _per_call(ctx, n)

    # the slot table's row: a small pinned host buffer into a device row, non-blocking
    E = 8
    th = torch.zeros(E, dtype=torch.int32, pin_memory=True)
    td = torch.zeros(E, dtype=torch.int32, device=dev)
    keep_busy()
    r["small pinned H2D copy_ (32 B)"] = _per_call(lambda: td.copy_(th, non_blocking=True), n)
    tn = th.numpy()

    def fill_row():
        tn.fill(-1)
        tn[3] = 1
        tn[5] = 0
    r["numpy row fill (3 ops)"] = _per_call(fill_row, n)

    # an expert's copy: a slice of a pinned block (the store's layout) into a device slot
    nb = 91 * 1024 * 1024
    block = torch.zeros((2, nb), dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(nb, dtype=torch.uint8, device=dev)
    k = 200
    with torch.cuda.stream(cp):
        r["expert H2D copy_ (91 MB, torch, slice + copy_)"] = _per_call(
            lambda: slot.copy_(block[1][:nb], non_blocking=True), k)
    cp.synchronize()
    lib, path = _cudart()
    r["cudart"] = path
    if lib is not None:
        src, dst, sh = block[1].data_ptr(), slot.data_ptr(), cp.cuda_stream
        r["expert H2D cudaMemcpyAsync (91 MB, ctypes)"] = _per_call(
            lambda: lib.cudaMemcpyAsync(dst, src, nb, 1, sh), k)
        cp.synchronize()
        e2 = torch.cuda.Event()
        e2.record(cs)
        eh = e2.cuda_event
        keep_busy()
        r["cudaEventRecord (ctypes)"] = _per_call(lambda: lib.cudaEventRecord(eh, cs.cuda_stream), n)
        r["cudaStreamWaitEvent (ctypes)"] = _per_call(lambda: lib.cudaStreamWaitEvent(sh, eh, 0), n)
        torch.cuda.synchronize()
        _executor_calls(r, n, dev, cs, keep_busy)

    # graph replays: one small kernel, and 12 small kernels
    x = torch.zeros(4096, device=dev)
    for name, ops in (("graph replay (1 kernel)", 1), ("graph replay (12 kernels)", 12)):
        s = torch.cuda.Stream(dev)
        s.wait_stream(cs)
        with torch.cuda.stream(s):
            for _ in range(3):
                for _ in range(ops):
                    x.add_(1.0)
        cs.wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(ops):
                x.add_(1.0)
        torch.cuda.synchronize()
        keep_busy()
        r[name] = _per_call(g.replay, 500)
        torch.cuda.synchronize()

    # the read-back: a small device buffer into pinned memory, an event, and the host's wait,
    # with the GPU idle (the round trip's floor)
    rb = torch.zeros(4, 16, device=dev)
    pin = torch.empty((4, 16), pin_memory=True)

    def roundtrip():
        pin.copy_(rb, non_blocking=True)
        e = torch.cuda.Event()
        e.record(cs)
        e.synchronize()
    torch.cuda.synchronize()
    r["read-back round trip, GPU idle"] = _per_call(roundtrip, 500)
    del busy
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n,
           "median_host_us": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    for k, v in out["median_host_us"].items():
        print(f"{k:50s} {v}")


if __name__ == "__main__":
    main()
