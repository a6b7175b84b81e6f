"""The lines `cmoe validate` and `cmoe run` add where the runs ran under other settings than the
profile was measured under: host settings that move a CPU expert's speed on the lent GPUs' hosts
(a validation's `omp_wait` and `cpu_pages`); each {"profile", "runs"}, None: unrecorded.

The few-expert switch (`few_experts`) is recorded on both sides too but gets no line: the
profile's launch fit is made of `upper`'s launches, which never switch, so a calibration under
another setting prices a run's launches the same. (Only its launches beside a load at batch 8 may
hold twinned ones, and those give what a load adds to a launch, not the launch's time. dae775b had
printed a line, which the forty-second session's review found claimed more than that.)
"""

from __future__ import annotations


def _cpu(v: dict) -> int:
    return v["op_kinds"].get("cpu_expert", {}).get("n", 0)


def _spins(policy: str | None) -> bool:
    return (policy or "").split()[:1] == ["ACTIVE"]


def omp_note(v: dict) -> str | None:
    """A line where a run's CPU experts ran under other OpenMP settings (wait policy, and a binding
    of the user's) than the profile's were measured under (`cmoe.executor.omp_wait`: the wait
    policy moved them 1.45-1.91x on the lent H100s), or under settings other than the default where
    the profile does not say (calibrated before cmoe recorded them). Without CPU experts, a line
    only where one side's team spun (`ACTIVE`) and the other's did not: the host's own steps
    moved with it (`host_note`)."""
    w = v.get("omp_wait") or {}
    prof, runs = w.get("profile"), w.get("runs")
    if not _cpu(v):
        return host_note(prof, runs)
    if runs is None or prof == runs or (prof is None and runs == "default"):
        return None
    said = f"under OpenMP {prof}" if prof else "under OpenMP settings it does not record"
    why = ("threads bound to cores or not ran them at other speeds in some calls on the lent H100s"
           if prof and prof.split()[0] == runs.split()[0] else
           "threads that spin or sleep between them moved them 1.45-1.91x on the lent H100s")
    return f"  the profile's CPU experts were measured {said}, the runs' ran under {runs}: {why}; calibrate under them"


def host_note(prof: str | None, runs: str | None) -> str | None:
    """GPU-only runs against a profile measured with the other spinning state (thirty-seventh
    session, `benchmarks/sampler_ab_h200.py`, H100: processes alternating ACTIVE and PASSIVE, pool
    26 batch 4: the spinning team took 16 of the host's 16 cores and slowed lru-prefetch and
    ondemand 0.7% and 1.3%, 542 of 768 LM-head host steps over 120 us against 166). The advice
    says how: `cmoe calibrate` sets ACTIVE on a GPU unless the variable is given or its `--policy`
    names GPU-only policies alone, and `cmoe run` calibrates GPU-only policies without it."""
    if prof is None or runs is None or _spins(prof) == _spins(runs):
        return None
    how = ("calibrate with --policy naming the runs' policies, or let cmoe run calibrate" if _spins(prof)
           else "calibrate with OMP_WAIT_POLICY=ACTIVE set")
    return (f"  the profile's host steps were measured under OpenMP {prof}, the runs' under {runs}: a team "
            f"spinning on every core slowed GPU-only runs 0.7-1.3% on a lent H100; {how}")


def pages_note(v: dict) -> str | None:
    """A line where a run's CPU experts sat on other pages than the profile's (`cmoe.core.hugepages`:
    on the lent H100s' hosts 2 MiB pages moved the CPU-expert runs -7% to +17%), or on huge pages
    where the profile does not say (calibrated before cmoe asked for them: its experts sat on 4 KiB)."""
    p = v.get("cpu_pages") or {}
    prof, runs = p.get("profile"), p.get("runs")
    if not _cpu(v) or runs is None or prof == runs or (prof is None and runs == "4 KiB pages"):
        return None
    said = f"on {prof}" if prof else "on pages it does not record (4 KiB before cmoe asked for huge ones)"
    return (f"  the profile's CPU experts were measured {said}, the runs' sat on {runs}: the same bytes on 2 MiB "
            "pages moved the CPU-expert runs -7% to +17% on the lent H100s' hosts; calibrate again")


def setting_notes(v: dict) -> list[str]:
    """Every such line of one validation, OpenMP's first."""
    return [n for n in (omp_note(v), pages_note(v)) if n]
