"""OpenMP threads that spin between parallel regions (`OMP_WAIT_POLICY=ACTIVE`) in a process that
runs CPU experts beside a GPU.

Why: torch's CPU kernels run on an OpenMP team (libgomp on Linux builds). By default its threads
sleep soon after a parallel region ends, and a CPU expert is one short region after a wait for the
GPU. On the lent H100's 16-core host the one-token CPU experts then ran in two states, ~1.0-1.2 ms
or ~1.6-2.0 ms, switching within a run (sessions 28-30). Under `ACTIVE` the threads spin instead:
isolated experts held 0.89-0.95 ms where the default process ran 7 of 8 arms 1.45-1.91x slower
(thirtieth session), and a whole validation's CPU experts sat at 0.86-1.11 ms in every part of
every run, its predictions within 3% in 14 of 18 configurations against 9 (thirty-first session;
BENCHMARKS.md). GPU-only policies ran at the same speed either way then (`upper` 221 tok/s, the
thirty-first session; but see below).

The price is CPU time: the team's threads keep their cores busy while the process lives (16 of
the H100 host's 16 through each validation, against a median of 1.1 under the default), and the
GPU-only runs' host beside them: thirty-seventh session, processes alternating ACTIVE and PASSIVE
(`benchmarks/sampler_ab_h200.py`, pool 26 batch 4), lru-prefetch and ondemand ran 0.7% and 1.3%
slower under ACTIVE (medians of 12 runs) and their LM-head host step took over 120 us in 542 of
768 steps against 166. The team cannot be stopped once it spins (a smaller parallel region leaves
the rest docked, spinning). So the CLI and `cmoe.execute` set it only for a process that will run
CPU experts (a CPU-expert policy, or `cmoe calibrate` for a profile that may serve one: its
`--policy`, `all` by default) on a GPU machine, never over the user's own `OMP_WAIT_POLICY`;
`cmoe run` of GPU-only policies calibrates without it. libgomp's default (threads that sleep soon
after a region) cost GPU-only runs nothing against `PASSIVE` (thirty-eighth session, medians 0.1%
apart), so nothing is set for them. libgomp reads the variables once, when torch loads it: set
later they do nothing, so this refuses then and says so. A program that loads torch before calling
cmoe sets them itself before that import.
A run's metrics and a calibration record the policy in force (`in_force`); a fitted profile keeps
it (`HardwareProfile.omp_wait_policy`), the simulator's metrics carry the profile's, and
`cmoe validate` names a CPU-expert run whose policy differs from its profile's, and a GPU-only run
whose team spun where its profile's did not or the other way round (`omp_note`).

Binding the team's threads to cores (`OMP_PROC_BIND`, `OMP_PLACES`, `GOMP_CPU_AFFINITY`) is the
user's to set; cmoe records it. Thirty-second session, lent H100 hosts (16-core Xeon), under
`ACTIVE`: unbound processes ran the 1-token experts in 1.25-2.55 ms and the 4-token ones in
2.28-4.49 (calls 2-3), bound ones 0.80-1.51 and 1.43-1.72 (calls 4-5, later), but in one call
whose processes alternated (call 6) neither was fast and bound was no better (4 tokens 2.24-3.44
bound against 2.01-2.58 unbound); on the twenty-ninth session's host binding changed nothing
(0.774 against 0.776 ms). So binding is not set by default: what held in calls 2-5 was the host
over time, as far as one controlled call can say. `in_force` records it after the policy, as
libgomp parses it (`describe`: e.g. `ACTIVE bind=close places=cores`), and `omp_note` names a
profile and runs that differ in it.
Under a binding libgomp pins the process's first thread (the engine's, and OpenMP's master) to the
first place when torch loads it, and threads started after inherit it; `sched_getaffinity` then
gives that place's CPUs, so the host's record counts the CPUs from before (`cores`).
"""

from __future__ import annotations

import os
import sys

VAR = "OMP_WAIT_POLICY"
NVIDIA_DEVICE = "/dev/nvidiactl"        # the driver's control node: a GPU machine, told without torch


def on_gpu(device: str) -> bool:
    """Will `--device` run on a GPU? `auto` is told by the NVIDIA driver's device node (and no
    `CUDA_VISIBLE_DEVICES` that hides every GPU), since torch, which `resolve_device` asks, must not
    be loaded yet."""
    if device == "auto":
        return os.path.exists(NVIDIA_DEVICE) and not _all_hidden(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return device.startswith("cuda")


def _all_hidden(visible: str | None) -> bool:
    """Does `CUDA_VISIBLE_DEVICES` hide every GPU? CUDA reads its list up to the first entry that
    names no device (an index, a GPU- or MIG- UUID), so an empty list or a bad first entry does."""
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


LATE = "torch was loaded before cmoe could set"      # in `spin_threads`' answer: nothing set, too late
USER_BIND = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")   # what binds libgomp's threads (the user's)


def _given(k: str, env=os.environ) -> bool:
    """Set to something (libgomp takes an empty variable as unset)."""
    return bool(env.get(k, "").strip())


def spin_threads(device: str, cpu_experts: bool) -> str:
    """Set `OMP_WAIT_POLICY=ACTIVE` for this process where it will run CPU experts on a GPU machine
    and the user has not set it. Returns what holds, in one line for the run's output (with any
    binding variable of the user's, `USER_BIND`); it contains `LATE` where torch was loaded first
    and the policy was left unset."""
    given = [f"{k}={os.environ[k].strip()}".replace("\n", " ") for k in (VAR, *USER_BIND) if _given(k)]
    said = [", ".join(given) + " as given"] if given else []
    if not cpu_experts or not on_gpu(device) or _given(VAR):
        return said[0] if said else "OpenMP's default wait policy (no CPU experts beside a GPU)"
    if "torch" in sys.modules:
        return "; ".join(said + [f"{LATE} {VAR}=ACTIVE"])
    os.environ[VAR] = "ACTIVE"
    return "; ".join(said + [f"{VAR}=ACTIVE (set by cmoe: CPU experts beside a GPU)"])


SPUN = ("spins OpenMP's threads for GPU-only policies, whose runs were 0.7-1.3% slower under it "
        "(thirty-seventh session); unset it for them")


def for_policies(device: str, policies) -> str | None:
    """`spin_threads` for a run of these policies (names), or a calibration for them: what holds, or
    None where no CPU experts run beside a GPU (nothing to set, nothing to say), except where the
    user's own `OMP_WAIT_POLICY=ACTIVE` spins the team for GPU-only ones on a GPU: that is said
    (`SPUN`), since it costs them and cmoe would not set it. The CLI's commands and `cmoe.execute`
    call it before they load torch."""
    from cmoe.policy.policies import any_trait
    if not on_gpu(device):
        return None
    if not any_trait(policies, "cpu_experts"):
        wait = os.environ.get(VAR, "").strip()
        return f"{VAR}={wait} as given {SPUN}" if policies and wait.upper() == "ACTIVE" else None
    return spin_threads(device, True)


_POLICIES = ("primary", "close", "spread")           # OMP_PROC_BIND's list items after the first


def _bind_list(v: str) -> list[str] | None:
    """OMP_PROC_BIND as libgomp parses it: `false` or `true` alone, or a list of primary (`master`,
    its old name), close and spread; None for anything else (libgomp warns and takes it as unset)."""
    items = ["primary" if x == "master" else x for x in (y.strip().lower() for y in v.split(","))]
    if items in (["false"], ["true"]) or (items and all(x in _POLICIES for x in items)):
        return items
    return None


def describe(env) -> str:
    """What libgomp makes of these variables (a mapping: the environment, or a run's record of it),
    as runs record it: the wait policy (`ACTIVE` or `PASSIVE`; `default` for anything else), then
    where the threads are bound ` bind=...` (the policy list, left out where it is just `true`
    beside places), ` places=...`, and ` affinity=...` (GOMP_CPU_AFFINITY: the places, unless
    OMP_PLACES is set). Unbound (`OMP_PROC_BIND=false`, or nothing set) the policy alone."""
    wait = env.get(VAR, "").strip().upper()
    wait = wait if wait in ("ACTIVE", "PASSIVE") else "default"
    bind = _bind_list(env.get("OMP_PROC_BIND", "")) if _given("OMP_PROC_BIND", env) else None
    if bind == ["false"]:
        return wait
    places = env["OMP_PLACES"].strip().lower() if _given("OMP_PLACES", env) else ""
    affinity = env["GOMP_CPU_AFFINITY"].strip() if _given("GOMP_CPU_AFFINITY", env) and not places else ""
    parts = [f"bind={','.join(bind)}"] if bind and not (bind == ["true"] and (places or affinity)) else []
    parts += [f"places={places}"] * bool(places) + [f"affinity={affinity}"] * bool(affinity)
    return " ".join([wait, *parts])


# the variables once torch is loaded: read at import where torch already is (`cmoe.executor.run`
# imports this after torch), else at the first `in_force` (the CLI imports this first, and only
# `spin_threads`, before torch, changes it there), so that a later change of the environment,
# which libgomp never sees, is not recorded as the runs'
_READ: str | None = describe(os.environ) if "torch" in sys.modules else None


def in_force() -> str:
    """The OpenMP settings this process's runs record, as libgomp read them once torch was loaded
    (`describe`): e.g. `ACTIVE bind=close places=cores`, or `default`."""
    global _READ
    if _READ is None:
        _READ = describe(os.environ)
    return _READ


def _mask() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):                  # not Linux
        return os.cpu_count() or 1


# the CPUs this process may use, taken before torch loads libgomp: under OMP_PROC_BIND libgomp pins
# the first thread to the first place then, and `sched_getaffinity` answers 1 after that
_CORES: int | None = None if "torch" in sys.modules else _mask()


def cores() -> int:
    """The CPUs this process may use, as its mask was before libgomp bound its first thread (read at
    import where torch was not loaded yet, which is so for the CLI, `cmoe.execute` and the
    benchmarks; else now, which under a binding of the user's own may say 1)."""
    return _CORES if _CORES is not None else _mask()
