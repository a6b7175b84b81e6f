"""The host thread on one core while a run's passes go (`CMOE_PIN_HOST`), an opt-in for the A/B.

On four H100 loans (forty-eighth session) the lean engine's host lane ran for tens of passes at
~2.4 us a layer's `host_attention`, then at ~5, and the pass boundary took 173-242 us in the fast
state against 553-601 in the slow one (`benchmarks/boundary_states.py`). Two speeds that each hold
for tens of passes look like the issuing thread moving between cores; `benchmarks/affinity_probe.py`
measured it with this switch (forty-ninth session, an H100): pinned and free runs, alternating in
one process, went slow together, so the slow state is the machine's, not the thread's core, and
the switch stays off by default, kept for repeating that A/B or pinning a whole run:

    CMOE_PIN_HOST=auto     the second core of those the process may use (the first is where the
                           kernel tends to put interrupts and other processes' work)
    CMOE_PIN_HOST=core:N   core N, which must be one the process may use
    unset or off           the thread as the OS schedules it (the default)

`os.sched_setaffinity(0, ...)` sets the calling thread's mask on Linux. The pin is held around a
run's passes (with what `cmoe.executor.run._passes` does before them: the host program's prepare,
the timing events) and the mask restored after; calibration's runs are pinned too where the variable
is set. A thread started inside the block keeps the one core for the rest of the process (the
mask is inherited, and only the caller's is restored), so torch's intra-op team is started before
the first pin (`_start_team`). `cmoe.executor.run` pins only a CUDA run of a GPU-only policy: on
the CPU the model itself runs on that team, and a CPU-expert policy's experts do. Each run's
metrics say which core it held (`host_core`, None: not pinned).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from cmoe.core.errors import CmoeError

ENV = "CMOE_PIN_HOST"


def pin_core(setting: str, allowed: set[int]) -> int | None:
    """The core `setting` (`CMOE_PIN_HOST`'s value) names among `allowed`, None for off."""
    s = setting.strip().lower()
    if s in ("", "off"):
        return None
    cores = sorted(allowed)
    if s == "auto":
        return cores[min(1, len(cores) - 1)]
    if s.startswith("core:") and s[5:].isdigit():
        n = int(s[5:])
        if n not in allowed:
            raise CmoeError(f"{ENV}={setting}: core {n} is not one this process may use ({_span(cores)}); "
                            "name one of those, or use auto")
        return n
    raise CmoeError(f"{ENV}={setting!r} is not a setting: use auto, core:N or off")


def _span(cores: list[int]) -> str:
    return f"cores {cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else f"cores {cores}"


def check_pin() -> None:
    """Refuse a `CMOE_PIN_HOST` that names no core, or that this OS cannot honour, in one line,
    before any work (`cmoe.executor.run.prepare`)."""
    s = os.environ.get(ENV, "")
    if hasattr(os, "sched_getaffinity"):
        pin_core(s, os.sched_getaffinity(0))
    elif s.strip().lower() not in ("", "off"):
        raise CmoeError(f"{ENV}={s} needs Linux's sched_setaffinity, which this OS lacks: unset it")


def _start_team() -> None:
    """Start torch's intra-op threads (a parallel region over a large tensor), so none is started
    inside a pin and kept on its core."""
    import torch
    torch.ones(1 << 20).sum()


def run_setting(cuda: bool, cpu_experts: bool) -> str | None:
    """`pinned_host`'s setting for one run: the variable's (None) for a CUDA run of a GPU-only
    policy, else off."""
    return None if cuda and not cpu_experts else "off"


@contextmanager
def pinned_host(setting: str | None = None) -> Iterator[int | None]:
    """Hold the calling thread on `pin_core`'s core (from `setting`, else `CMOE_PIN_HOST`) inside
    the block, its mask restored after; yields the core, or None where unpinned (also where the OS
    has no `sched_setaffinity`)."""
    s = os.environ.get(ENV, "") if setting is None else setting
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    core = pin_core(s, before)
    if core is None:
        yield None
        return
    _start_team()
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)
