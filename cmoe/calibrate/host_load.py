"""What else the host's CPUs did while a run ran (issue 15): a sampler of /proc/stat and this
process's own CPU time, read as cores busy with other work and cores stolen by the hypervisor.

Why: a CPU expert's speed on the lent GPU hosts moves between two states within one run (one-token
experts at ~1.0-1.2 ms and at ~1.6-2.0 ms, switching once or twice a run, BENCHMARKS.md "thirtieth
session"), which no calibration can predict. A 16-thread OpenMP loop over 16 cores runs at the
pace of its slowest thread, so one core taken by anything else (another process, the hypervisor)
costs it nearly 2x. The sampler says whether that is what the slow stretches are: other cores'
load and steal per window, lined up with the run's timelines by epoch time.

Linux only (elsewhere `available()` is False and the sampler records nothing). A child process
(this file run as a script) wakes every `interval` seconds for a read of two small files and
appends the sample to a file the sampler reads back: a 17th runnable thread beside 16 OpenMP ones
for ~60 us, ten times a second, and nothing in this process. Until the thirty-sixth session it
was a thread of this process, and it stalled the host it watched: the compiled host program
(`cmoe.executor.host_program`) held the GIL through a whole pass, its read-back syncs included
(it runs without it since, `nogil`), so the thread's wake-ups waited for a pass to end and then
ran in the next pass's start. On an H100's 16-core host 782 of the 871 LM-head steps over 120 us in a
validation's read-back runs held a sample's time, and none of the 713 under it
(`benchmarks/sampler_heads.py`; calibrated 39 us, these 200-450), and the GPU waited for them at
layer 0. The next validation, sampled from a child process, had 8 of 1,328 (BENCHMARKS.md,
thirty-sixth session).
"""

from __future__ import annotations

import atexit
import bisect
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAT, SELF = Path("/proc/stat"), Path("/proc/self/stat")
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100     # the ticks /proc counts in
IRQ, SOFTIRQ, STEAL = 5, 6, 7     # /proc/stat's cpu line fields after the name (user nice system idle iowait ...)


def available() -> bool:
    return STAT.exists() and SELF.exists()


def parse_stat(text: str) -> tuple[int, int, int, int]:
    """(process ticks, interrupt ticks, steal ticks, online CPUs) from /proc/stat's text, over all
    CPUs: process ticks are user + nice + system (guest time is already inside user), interrupt
    ticks irq + softirq (charged to a CPU, not to a process: a GPU's interrupts among them)."""
    f = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    if len(f) < STEAL + 1:
        raise ValueError("/proc/stat's first line has fewer than 8 fields")
    cpus = sum(1 for ln in text.splitlines() if ln.startswith("cpu") and ln[3:4].isdigit())
    return f[0] + f[1] + f[2], f[IRQ] + f[SOFTIRQ], f[STEAL], cpus


def parse_self(text: str) -> int:
    """This process's user + system ticks from /proc/self/stat (fields 14 and 15; the command name,
    field 2, may hold spaces, so fields count from its closing parenthesis)."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def snapshot(pid: int | None = None) -> tuple[float, int, int, int, int, int]:
    """One sample now: (epoch, process ticks, interrupt ticks, steal ticks, the process's ticks
    (this one's, or `pid`'s), CPUs)."""
    proc, irq, steal, cpus = parse_stat(STAT.read_text())
    return time.time(), proc, irq, steal, parse_self((SELF if pid is None else Path(f"/proc/{pid}/stat")).read_text()), cpus


def windows(samples: list[tuple], hz: int) -> list[dict]:
    """Per interval between consecutive samples (`snapshot`'s): its start and end (epoch seconds),
    and in cores averaged over it: this process's (`ours`), other processes' (`other`: all
    processes' less ours, signed, since /proc/stat counts timer ticks while this process's time is
    the scheduler's exact runtime rounded to ticks, a few ticks of noise either way per window:
    clamp after averaging, `mean_over`), interrupts (`irq`) and the hypervisor's (`steal`)."""
    out = []
    for (t0, p0, i0, s0, o0, n), (t1, p1, i1, s1, o1, _) in zip(samples, samples[1:]):
        dt = (t1 - t0) * hz
        if dt <= 0:
            continue
        out.append({"t0": t0, "t1": t1, "cpus": n, "ours": (o1 - o0) / dt, "other": (p1 - p0 - (o1 - o0)) / dt,
                    "irq": (i1 - i0) / dt, "steal": (s1 - s0) / dt})
    return out


def at(rows: list[dict], t: float, starts: list[float] | None = None) -> dict | None:
    """The window (`windows`' rows, in time order) that holds epoch time t, or None; `starts`: the
    rows' `t0`s, for a caller that asks many times."""
    i = bisect.bisect_right(starts if starts is not None else [r["t0"] for r in rows], t) - 1
    return rows[i] if i >= 0 and t < rows[i]["t1"] else None


KEYS = ("ours", "other", "irq", "steal")


def mean_over(rows: list[dict], t0: float, t1: float) -> dict | None:
    """`KEYS` over epoch [t0, t1], each window weighted by its overlap, `other` clamped at 0 after
    averaging; None where no window overlaps (a span shorter than the sampling interval may see
    only part of one: time such a span with two `snapshot`s instead)."""
    w = [(min(r["t1"], t1) - max(r["t0"], t0), r) for r in rows]
    w = [(d, r) for d, r in w if d > 0]
    tot = sum(d for d, _ in w)
    if not tot:
        return None
    m = {k: sum(d * r.get(k, 0.0) for d, r in w) / tot for k in KEYS}
    return m | {"other": max(m["other"], 0.0)}


class LoadSampler:
    """`with LoadSampler() as s:` (or `start()` ... `stop()`) samples every `interval` seconds until
    the block ends, in a child process (`_child`); `s.samples` and `s.windows()` (`windows`) give
    the samples so far, also while it samples. Records nothing where /proc is absent."""

    def __init__(self, interval: float = 0.1):
        self.interval, self._done = interval, []
        self._child, self._file = None, None

    @property
    def samples(self) -> list[tuple]:
        return self._done + (_read(self._file) if self._file else [])

    def start(self) -> LoadSampler:
        if available() and self._child is None:
            fd, name = tempfile.mkstemp(prefix="cmoe-host-load-", suffix=".txt")
            os.close(fd)
            self._file = Path(name)
            try:
                with self._file.open("a") as f:
                    f.write(_line(snapshot()))
                self._child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(os.getpid()),
                                                repr(self.interval), name], stdin=subprocess.DEVNULL, close_fds=True)
            except BaseException:
                self._file.unlink(missing_ok=True)
                self._file = None
                raise
            atexit.register(self.stop)
        return self

    def stop(self) -> None:
        if self._child is not None:
            self._child.terminate()
            try:
                self._child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child = None
            with self._file.open("a") as f:
                f.write(_line(snapshot()))
            self._done += _read(self._file)
            self._file.unlink(missing_ok=True)
            self._file = None
            atexit.unregister(self.stop)

    def __enter__(self) -> LoadSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def windows(self) -> list[dict]:
        return windows(self.samples, HZ)


def _line(sample: tuple) -> str:
    return " ".join(repr(v) for v in sample) + "\n"


def _read(path: Path) -> list[tuple]:
    """The samples a file holds, whole lines only (the child may be writing the last)."""
    out = []
    for ln in path.read_text().split("\n")[:-1]:
        f = ln.split()
        if len(f) == 6:
            out.append((float(f[0]), *(int(x) for x in f[1:])))
    return out


def _child(pid: int, interval: float, path: str) -> None:
    """Append `pid`'s sample to `path` every `interval` seconds, until terminated (`stop`) or `pid`
    is no longer this process's parent (it ended, killed past its `atexit`: `timeout`'s SIGTERM or
    a SIGKILL); then the file, which no one will read, goes too."""
    with open(path, "a", buffering=1) as f:
        while os.getppid() == pid:
            time.sleep(interval)
            try:
                f.write(_line(snapshot(pid)))
            except (FileNotFoundError, ProcessLookupError):
                break
    Path(path).unlink(missing_ok=True)


if __name__ == "__main__":
    _child(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
