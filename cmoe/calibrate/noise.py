"""The noise verdict on a calibration: what the repeats of its measurements say about the machine
it ran on (`noise` gives a `Noise`), the line `cmoe calibrate` prints (`verdict`; `--strict` makes
a noisy one a refusal) and the line `cmoe run` prints beside its errors (`run_verdict`). The
measurements' own repeats are read by `cmoe.calibrate.profile_fit.noise_of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmoe.analysis.validate import CPU_NOTE
from cmoe.core.errors import CmoeError

# Seen on the lent H200 (2026-12-01, seven calibrations): quiet, the first repeat is often the
# slowest by 20-60%, so a range would flag every run; with 9 repeats the relative IQRs of judged
# points stay under 15% but for the latency-bound 64-256 KiB copies (up to 29%, a few us), which
# also swap order by about 1 us. Pageable copies spread 20-35% at any size, quiet: shown, not
# judged (the profile keeps only their largest point; loads are pinned). Under a GPU + CPU hog the
# CPU expert (13x) and the round trip (35x) slowed with every repeat alike, which no spread can see
# (the verdict caught only the 64 KiB copy's 33%): curves that fall are the other witness.
SPREAD_LIMIT = 0.25     # relative IQR of one point's repeats above which the machine was busy ...
JITTER_S = 10e-6        # ... unless the IQR is below this: driver and launch jitter, far below a decode layer
FALL_SLACK = 0.05       # a bigger copy or more rows may time this much (and JITTER_S) faster before it counts


def spread(seconds: list[float]) -> float:
    """Relative IQR of one point's repeats: (75th - 25th percentile) / median; one slow repeat
    (the first, often) does not decide it."""
    q1, med, q3 = np.percentile(seconds, [25, 50, 75])
    return float((q3 - q1) / med)


def _at(unit: str | None, x) -> str:
    return size_label(int(x)) if unit == "bytes" else f"{x} tokens" if unit == "tokens" else \
        f"{x:g} keys" if unit == "keys" else ""


def point_label(what: str, unit: str | None, x) -> str:
    """A point's name, as the measured-vs-fitted table spells its row."""
    return f"{what} {_at(unit, x)}" if unit == "bytes" else f"{what}, {_at(unit, x)}" if unit in ("tokens", "keys") else what


@dataclass(frozen=True)
class Noise:
    """What a calibration's repeats say about the machine it ran on."""
    spreads: tuple[tuple[str, float], ...]      # (point, spread) of every point measured more than once
    falls: tuple[str, ...]                      # "D2H pinned 16 MiB faster than 4 MiB": curves that do not grow
    wide: tuple[tuple[str, float], ...] = ()    # the spreads over `limit` (and JITTER_S)
    widest: tuple[str, float] | None = None     # the widest spread of the judged points
    limit: float = SPREAD_LIMIT

    @property
    def quiet(self) -> bool:
        return not self.wide and not self.falls

    def summary(self) -> str:
        """quiet or noisy, and why, in a few words."""
        if self.quiet:
            if self.widest is None:
                return "quiet as far as one repeat per point can tell (no spread recorded)"
            what, s = self.widest
            return (f"quiet (spreads within {self.limit * 100:.0f}% or {JITTER_S * 1e6:.0f} us; widest {s * 100:.1f}% "
                    f"at {what})")
        why = []
        if self.wide:
            what, s = max(self.wide, key=lambda p: p[1])
            why.append(f"{len(self.wide)} point{'s' * (len(self.wide) > 1)} spread over {self.limit * 100:.0f}% "
                       f"(worst {s * 100:.1f}% at {what})")
        if self.falls:
            more = f" and {len(self.falls) - 1} more curve falls" if len(self.falls) > 1 else ""
            why.append(self.falls[0] + more)
        return "noisy: " + " and ".join(why)

    def line(self) -> str:
        """The one line calibrate prints."""
        if self.quiet:
            return f"calibration {self.summary()}; copy and expert times grow with size and rows"
        return (f"warning: calibration {self.summary()}: the machine was busy and the profile may be off; "
                "rerun cmoe calibrate on a quiet machine (--strict refuses such a profile)")

    def to_dict(self) -> dict:
        return {"quiet": self.quiet, "spread_metric": "relative IQR", "limit": self.limit, "jitter_s": JITTER_S,
                "fall_slack": FALL_SLACK, "spread": [list(p) for p in self.spreads], "wide": [k for k, _ in self.wide],
                "falls": list(self.falls), "verdict": self.line()}


def noise(repeats: dict, limit: float = SPREAD_LIMIT) -> Noise:
    """Judge `repeats` ({what: {"unit", "grows", "judged" (default true), "points": [(x, [seconds])]}}):
    every point's spread (wide: over `limit` and JITTER_S), and each growing curve's best times in
    order of x, which may not fall by more than FALL_SLACK and JITTER_S from one point to the next.
    A curve with "judged": false is only shown (its spread kept, never a reason to warn)."""
    spreads, wide, falls, widest = [], [], [], None
    for what, c in repeats.items():
        unit, pts, judged = c.get("unit"), sorted((x, list(ts)) for x, ts in c["points"]), c.get("judged", True)
        for x, ts in pts:
            if len(ts) > 1:
                spreads.append((point_label(what, unit, x), spread(ts)))
                if judged:
                    widest = max(widest or spreads[-1], spreads[-1], key=lambda p: p[1])
                if judged and spreads[-1][1] > limit and spreads[-1][1] * float(np.median(ts)) > JITTER_S:
                    wide.append(spreads[-1])
        if judged and c.get("grows"):
            best = [(x, min(ts)) for x, ts in pts]
            falls += [f"{point_label(what, unit, x1)} faster than {_at(unit, x0)}"
                      for (x0, t0), (x1, t1) in zip(best, best[1:]) if t1 < t0 * (1 - FALL_SLACK) and t0 - t1 > JITTER_S]
    return Noise(tuple(spreads), tuple(falls), tuple(wide), widest, limit)


def size_label(b: int) -> str:
    """A byte count as the tables spell it: 4 MiB, 64 KiB."""
    return f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 2**10:g} KiB"


def verdict(n: Noise, strict: bool, measurements: str) -> str:
    """The line calibrate prints; with `strict`, a noisy verdict is a refusal instead."""
    if strict and not n.quiet:
        raise CmoeError(f"calibration is too noisy to trust ({n.summary()}); no profile written, the measurements "
                        f"are in {measurements}: rerun cmoe calibrate on a quiet machine, or without --strict")
    return n.line()


HOST_DRIFT = 0.2     # a run's host this much faster or slower per layer than calibrated has moved
LINK_DRIFT = 0.03    # a run's loads this much faster or slower than the calibrated link: as large as the goal


def _moved(ratios: list[float] | None, by: float) -> bool:
    """Did any run's ratio against its calibration leave 1 by more than `by`?"""
    return bool(ratios) and (max(ratios) > 1 + by or min(ratios) < 1 - by)


def run_verdict(cal: Noise | None, errors: list[float], run_spreads: list[float] | None,
                host_speed: list[float] | None = None, link_speed: list[float] | None = None,
                cpu_speed: list[float] | None = None) -> str:
    """The line `cmoe run` prints beside its errors: how noisy the calibration (None: not measured
    here) and the repeated runs ((max - min) / mean of each policy's tokens/s; None: one run) were,
    how long the runs' host took per layer against the calibration (`host_speed`, each run's ratio;
    the H200's host drifted 2x within minutes), how fast their loads moved against the calibrated
    link (`link_speed`, each run's ratio; the H200's link drifted 7% in spells of seconds), how long
    their CPU experts took against the calibration (`cpu_speed`, each CPU-expert run's ratio; an
    H100's host ran them at 0.60-1.18x within one validation, forty-fifth session; beyond
    `CPU_NOTE`, as `cmoe.analysis.validate` notes a run, the verdict names them), and whether the
    errors stand above that noise."""
    lo, hi = min(errors), max(errors)
    err = f"error {lo * 100:+.1f}%" if len(errors) == 1 else f"errors {lo * 100:+.1f}% to {hi * 100:+.1f}%"
    parts = [err, "calibration not measured (a profile without its measurements)" if cal is None
             else f"calibration {cal.summary()}"]
    parts.append(f"repeated runs spread up to {max(run_spreads) * 100:.1f}%" if run_spreads
                 else "one run, its own spread not measured (--repeat 3 measures it)")
    if host_speed:
        parts.append(f"the runs' host took {min(host_speed):.2f}-{max(host_speed):.2f}x its calibrated time per layer")
    if link_speed:
        parts.append(f"their loads moved at {min(link_speed):.3f}-{max(link_speed):.3f}x the calibrated link")
    if cpu_speed:
        parts.append(f"their CPU experts took {min(cpu_speed):.2f}-{max(cpu_speed):.2f}x their calibrated time")
    drifted, link_drifted, cpu_drifted = (_moved(host_speed, HOST_DRIFT), _moved(link_speed, LINK_DRIFT),
                                          _moved(cpu_speed, CPU_NOTE))
    worst = max(abs(e) for e in errors)
    if cal is not None and not cal.quiet:
        then = "recalibrate on a quiet machine before reading these errors"
    elif drifted and cpu_drifted:            # both named: CPU-expert runs drift in both (forty-fifth session)
        then = ("the host and its CPU experts ran at other speeds than when they were calibrated: where either "
                "bounds a policy, its error follows the host, not the model")
    elif drifted:
        then = ("the host ran at another speed than when it was calibrated: where the host bounds a policy, "
                "its error follows the host, not the model")
    elif cpu_drifted:
        then = ("the CPU experts ran at another speed than when they were calibrated: where they bound a policy, "
                "its error follows the host's CPU, not the model")
    elif link_drifted:
        then = ("the link ran at another speed than when it was calibrated: where the loads bound a policy, "
                "its error follows the link, not the model")
    elif run_spreads and max(run_spreads) >= worst:
        then = "the runs' own noise is as large as the errors, which say little about the model"
    elif run_spreads or cal is not None:
        then = "the errors stand above the noise measured"
    else:
        then = "nothing here measured the machine's noise"
    return "noise: " + "; ".join(parts) + ": " + then
