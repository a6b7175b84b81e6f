"""The compiled host program runs without the GIL (`cmoe.executor.host_program.run`, `nogil`):
another Python thread of the process runs while a pass waits on its read-backs. Until the
thirty-sixth session the program held the GIL through a pass, and the validation's sampler thread,
frozen meanwhile, ran at the next pass's start instead (BENCHMARKS.md)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import numpy as np
import pytest

from cmoe.executor.host_calls import F_COPY, F_LAUNCH, F_RECORD, F_SYNC, F_WAIT, address
from cmoe.sim.replay.state import export, pass_data
from cmoe.sim.replay.twin_pool import decisions
from tests.test_host_program import _FAKE, Reference, _books, _prefilled, _prog, _setup, hp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc's usleep and sched_yield by address")
def test_another_thread_runs_while_a_pass_waits_on_its_read_backs():
    """The program's runtime calls are C functions here, none a Python callback: its launches,
    records, waits and copies libc's sched_yield (0, nothing done), its syncs libc's usleep of the
    event's number (7000-7002: 7 ms a read-back), so a pass is ~21 ms of waiting in machine code.
    A thread that counts in Python meanwhile must count, inside the passes, at least half as much
    as it counts beside a plain sleep as long; holding the GIL, the program let it count 0.2x."""
    libc = ctypes.CDLL(None)
    t, pa, lay, make = _setup("ondemand")
    M, E, S = len(lay.slots), t.spec.num_experts, max(lay.slots)
    prog = _prog(M, E, S, W=min(4, E) + 1)
    prog.fn[:] = _FAKE.fn
    for f in (F_LAUNCH, F_RECORD, F_WAIT, F_COPY):
        prog.fn[f] = address(libc.sched_yield)
    prog.fn[F_SYNC] = address(libc.usleep)
    ref = Reference(_prefilled(make, pa, M), prog, M, S)
    s, pd, d = export(_prefilled(make, pa, M), pa), pass_data(pa), decisions(M + 1, 1, E)
    pool, b = hp.pool_of(np.array(ref.expert)), _books(M, E, S, prog)
    ts, waves = np.zeros(2, np.int64), np.zeros(E, np.int64)
    run = hp.compile_for(hp.run, prog, pool, s, d, pd, b, 0, 0, 0, ts, waves)
    stamps, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            stamps.append(time.perf_counter())
    th = threading.Thread(target=count, daemon=True)
    th.start()
    try:
        inside = []
        for p in range(1, pa.num_passes):
            t0 = time.perf_counter()
            assert run(prog, pool, s, d, pd, b, 0, p, pa.num_passes, ts, waves) == 0
            inside.append((t0, time.perf_counter()))
        took = sum(z - a for a, z in inside)
        s0 = time.perf_counter()
        time.sleep(took)                                 # the same time with the GIL free
        beside = (s0, time.perf_counter())
    finally:
        stop.set()
        th.join()
    st = np.array(stamps)
    during = sum(int(((st > a) & (st < z)).sum()) for a, z in inside)
    free = int(((st > beside[0]) & (st < beside[1])).sum())
    assert took > 0.1 and free > 0
    assert during >= 0.5 * free, (during, free)
