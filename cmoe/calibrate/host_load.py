"""What else the host's CPUs did while a run ran (issue 15): a sampler of /proc/stat and this
process's own CPU time, read as cores busy with other work and cores stolen by the hypervisor.

Why: a CPU expert's speed on the lent GPU hosts moves between two states within one run (one-token
experts at ~1.0-1.2 ms and at ~1.7-2.0 ms, switching once or twice a run, BENCHMARKS.md "thirtieth
session"), which no calibration can predict. A 16-thread OpenMP loop over 16 cores runs at the
pace of its slowest thread, so one core taken by anything else (another process, the hypervisor)
costs it nearly 2x. The sampler says whether that is what the slow stretches are: other cores'
load and steal per window, lined up with the run's timelines by epoch time.

Linux only (elsewhere `available()` is False and the sampler records nothing). One daemon thread
wakes every `interval` seconds for a read of two small files (~0.1 ms, holding the GIL that long).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

STAT, SELF = Path("/proc/stat"), Path("/proc/self/stat")
IDLE, IOWAIT, STEAL = 3, 4, 7          # /proc/stat's cpu line fields after the name (user nice system idle ...)


def available() -> bool:
    return STAT.exists() and SELF.exists()


def parse_stat(text: str) -> tuple[int, int, int]:
    """(busy ticks, steal ticks, online CPUs) from /proc/stat's text: busy is every field but idle,
    iowait and steal (guest time is already inside user), over all CPUs."""
    f = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    if len(f) < STEAL + 1:
        raise ValueError("/proc/stat's first line has fewer than 8 fields")
    cpus = sum(1 for ln in text.splitlines() if ln.startswith("cpu") and ln[3:4].isdigit())
    busy = sum(f[:8]) - f[IDLE] - f[IOWAIT] - f[STEAL]
    return busy, f[STEAL], cpus


def parse_self(text: str) -> int:
    """This process's user + system ticks from /proc/self/stat (fields 14 and 15; the command name,
    field 2, may hold spaces, so fields count from its closing parenthesis)."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def windows(samples: list[tuple[float, int, int, int, int]], hz: int) -> list[dict]:
    """Per interval between consecutive samples (epoch, busy, steal, ours, cpus): its start and end
    (epoch seconds), the cores busy with work not this process's (`other`), this process's cores
    (`ours`) and the cores stolen (`steal`), each averaged over the interval."""
    out = []
    for (t0, b0, s0, o0, n), (t1, b1, s1, o1, _) in zip(samples, samples[1:]):
        dt = (t1 - t0) * hz
        if dt <= 0:
            continue
        out.append({"t0": t0, "t1": t1, "cpus": n, "ours": (o1 - o0) / dt,
                    "other": max(b1 - b0 - (o1 - o0), 0) / dt, "steal": (s1 - s0) / dt})
    return out


def at(rows: list[dict], t: float) -> dict | None:
    """The window (`windows`' rows, in time order) that holds epoch time t, or None."""
    i = bisect.bisect_right([r["t0"] for r in rows], t) - 1
    return rows[i] if i >= 0 and t < rows[i]["t1"] else None


def mean_over(rows: list[dict], t0: float, t1: float) -> dict | None:
    """`other`, `ours` and `steal` over epoch [t0, t1], each window weighted by its overlap; None
    where no window overlaps."""
    w = [(min(r["t1"], t1) - max(r["t0"], t0), r) for r in rows]
    w = [(d, r) for d, r in w if d > 0]
    tot = sum(d for d, _ in w)
    return {k: sum(d * r[k] for d, r in w) / tot for k in ("other", "ours", "steal")} if tot else None


class LoadSampler:
    """`with LoadSampler() as s:` (or `start()` ... `stop()`) samples every `interval` seconds until
    the block ends; `s.windows()` gives the intervals so far (`windows`), also while it samples.
    Records nothing where /proc is absent."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.samples = interval, []
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread = None

    def sample(self) -> None:
        busy, steal, cpus = parse_stat(STAT.read_text())
        self.samples.append((time.time(), busy, steal, parse_self(SELF.read_text()), cpus))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> LoadSampler:
        if available() and self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._loop, name="cmoe-host-load", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()

    def __enter__(self) -> LoadSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def windows(self) -> list[dict]:
        return windows(list(self.samples), self.hz)
