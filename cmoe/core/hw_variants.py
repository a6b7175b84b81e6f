"""What a `HardwareProfile` derives from itself: the same profile with part of the machine faster
or slower (`host_scaled`, `cpu_scaled`, `link_scaled`, `python_step`: the diagnoses of
`benchmarks/validate_table.py` and the Python step's host), and the measured slow-down factors
read off its tables (`host_wake`, `cpu_wake_us`), and the host's steps as both simulator engines
read them (`host_layer`, `host_pass_start`, `first_mark`, ...). A mixin of
`cmoe.core.hw.HardwareProfile`, apart so that the profile's fields and checks read in one file."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cmoe.core.hw_math import held, table_us

if TYPE_CHECKING:
    from cmoe.core.hw import HardwareProfile

# the profile's costs that are the host thread's (`HardwareProfile.host_scaled`)
HOST_FIELDS = ("host_layer_us", "host_attn_us_per_token", "host_sync_us", "host_route_us", "host_route_us_per_token",
               "host_expert_us", "host_expert_us_per_token", "host_expert_tail_us", "host_load_us",
               "host_pass_start_us", "host_head_us", "pass_gap_us", "predict_layer_us", "commit_route_us",
               "commit_start_us", "cpu_lead_us", "cpu_gap_us", "cpu_tail_us", "cpu_pass_start_us",
               "cpu_pass_gap_us")
HOST_POINTS = ("host_layer_points", "host_route_points", "host_expert_points")


class Variants:
    def host_scaled(self, k: float) -> "HardwareProfile":
        """This profile with every cost of the host thread k times as long (the GPU's, the link's and
        the CPU experts' unchanged; the Python step's too): a host k times slower than calibrated."""
        def table(v):                                            # (x, us) points: their times
            return tuple((x, y * k) for x, y in v)

        def scaled(f: str, v):                                   # a table's times, or the time
            return table(v) if f in HOST_POINTS else v * k
        return replace(self, **{f: scaled(f, getattr(self, f)) for f in (*HOST_FIELDS, *HOST_POINTS)},
                       python_host={f: scaled(f, v) for f, v in self.python_host.items()},
                       host_pass_start_points=table(self.host_pass_start_points),
                       host_boundary_points=table(self.host_boundary_points))

    def python_step(self) -> "HardwareProfile":
        """The host where the compiled host program does not plan (`CMOE_HOST_PROGRAM=0`: the
        executor's Python step): this profile with `python_host`'s fields, if calibrate measured them."""
        return replace(self, python_host={}, **self.python_host) if self.python_host else self

    def cpu_scaled(self, k: float) -> "HardwareProfile":
        """This profile with every CPU expert k times as long (the round trip unchanged)."""
        return replace(self, cpu_expert_gbps=self.cpu_expert_gbps / k, cpu_expert_us_per_token=self.cpu_expert_us_per_token * k,
                       cpu_wake_points=tuple((i, y * k) for i, y in self.cpu_wake_points))

    def link_scaled(self, k: float) -> "HardwareProfile":
        """This profile with pinned host-to-device copies at k times the calibrated bandwidth (every
        size; the read-backs, the GPU and the host unchanged): a link that ran k times as fast as
        when it was calibrated (the H200's drifted between 49 and 55.4 GB/s within a session)."""
        return replace(self, h2d_pinned=tuple((b, g * k) for b, g in self.h2d_pinned))

    def host_wake(self, wait_us: float) -> float:
        """How much slower the route step runs after a read-back wait of `wait_us`: the measured
        factors read piecewise-linearly, held flat outside them (1 with none measured)."""
        return held(self.host_wake_points, wait_us, 1.0)

    def roundtrip(self, rows: int) -> float:
        """A CPU layer's round trip (its input to the host and the CPU experts' sum back) at a
        pass of `rows` rows: `roundtrip_points` where measured (batch 1's was 77-97 us on an
        H100's host, batch 8's 106-140), else `roundtrip_us`."""
        return table_us(self.roundtrip_points, rows) if self.roundtrip_points else self.roundtrip_us

    def cpu_wake_us(self, idle_us: float) -> float:
        """How much longer a CPU expert takes after the CPU idled `idle_us` since the last one ended:
        `cpu_wake_points` (idle us, extra us) read as `host_wake`'s, 0 with none measured. Added, not
        a factor: on an H100's host the extra was ~0.2-0.5 ms at 1-4 tokens alike."""
        return held(self.cpu_wake_points, idle_us, 0.0)

    def pass_start_extra_us(self, prev_us: float) -> float:
        """What the host pass start `host_pass_start_us` prices takes more after a decode pass of
        `prev_us` (not a CPU-expert policy's own, `cpu_pass_start_us`, where calibrated):
        `host_pass_start_points` (pass us, extra us) read as `cpu_wake_us`'s, 0 with none measured.
        Two H100 hosts (thirty-sixth session) started a pass in 102 and 136 us after 5 ms passes,
        264 and 314 after 104 ms ones, whatever the pass waited on (`cmoe.calibrate.wake.fit_pass_start`)."""
        return held(self.host_pass_start_points, prev_us, 0.0)

    def boundary_extra_us(self, wait_us: float) -> float:
        """What the next pass's start takes more after a decode pass whose last read-back waited
        `wait_us` (not a CPU-expert policy's own start): `host_boundary_points` (wait us, extra us)
        read as `cpu_wake_us`'s, 0 with none measured. On an H100 (forty-fifth session) the LM head's
        host step and the next start took ~150 us where a pass's last wait was under 150 us and ~600
        where it was a load's 1-5 ms (`cmoe.calibrate.wake.fit_boundary`)."""
        return held(self.host_boundary_points, wait_us, 0.0)

    def boundary_price_us(self, prev_us: float, wait_us: float, cpu_experts: bool = False) -> float:
        """The host's pass boundary as both simulator engines charge it after a decode pass of
        `prev_us` whose last read-back waited `wait_us`: the LM head's host step and the next pass's
        start with its extras (`pass_start_extra_us`, `boundary_extra_us`; neither on a CPU-expert
        policy's own start, `startup_after_host`). `cmoe.analysis.boundary` and calibrate's
        `beside` hold measured boundaries against it."""
        extra = 0.0 if self.startup_after_host(cpu_experts) else self.pass_start_extras_us(prev_us, wait_us)
        return self.host_head_us + self.host_pass_start(cpu_experts) + extra

    def pass_start_extras_us(self, prev_us: float, wait_us: float) -> float:
        """What a pass start takes over `host_pass_start_us` after a decode pass of `prev_us` whose last
        read-back waited `wait_us` (`pass_start_extra_us` plus `boundary_extra_us`), as `Simulation`
        charges it and `boundary_price_us` prices it (the replay's `_begin` reads the same two tables)."""
        return self.pass_start_extra_us(prev_us) + self.boundary_extra_us(wait_us)

    def host_wake_base(self, tokens: int) -> float:
        """`host_wake` at the wait `host_route(tokens)` was measured after: the simulator scales the
        route step by host_wake(wait) / this, so a point measured after a longer wait is not
        slowed twice (1 without `host_route_waits`; past its last batch, that batch's wait)."""
        w = self.host_route_waits
        return self.host_wake(table_us(w, min(tokens, w[-1][0]))) if w else 1.0

    def cpu_layer_unmeasured(self) -> bool:
        """A calibrated profile without the host's measured time around a CPU layer's experts
        (`cpu_lead_us`, `cpu_gap_us`, `cpu_tail_us`: calibrate reads them off CPU experts run inside
        the model, since the twenty-eighth session): calibrated before then, or on a model that
        held no CPU copies of the experts (`cmoe run` with GPU-only policies on a GPU calibrates on
        the model it built for them; `cmoe calibrate --policy` naming GPU-only policies alone runs
        no CPU expert inside its model, on any device). Those costs then read 0; before they were priced, the
        CPU-expert policies came out 16-104% fast on an H100 (BENCHMARKS.md, twenty-seventh
        session). The built-in profiles are estimates throughout and say so; they are not this."""
        return (self.sources.get("cpu_expert_gbps", "").startswith("measured by cmoe calibrate")
                and not any(f in self.sources for f in ("cpu_lead_us", "cpu_gap_us", "cpu_tail_us")))

    # the host's steps, as both engines read them ---------------------------------------------
    @property
    def pass_gap(self) -> float:
        """`pass_gap_us` as both simulator engines read it: never more than the host's whole pass
        start it is a part of."""
        return min(self.pass_gap_us, self.host_pass_start_us)

    def host_pass_start(self, cpu_experts: bool) -> float:
        """The host's pass start under a policy: a CPU-expert policy's own where calibrate measured it
        on its `static` runs (`cpu_pass_start_us`: their host's books and start-up fall in the GPU's
        idle, 205-387 us a pass on an H100 where the eager GPU-only runs paid 146-164, thirtieth
        session), else `host_pass_start_us`. Measured with the host program on: a Python-step
        profile (`python_step`) keeps it, the one pass-start figure it has for these policies."""
        return self.cpu_pass_start_us if self.startup_after_host(cpu_experts) else self.host_pass_start_us

    def startup_after_host(self, cpu_experts: bool) -> bool:
        """Does the policy pay a CPU-expert pass start of its own (`cpu_pass_start_us`, calibrated)?
        Then the GPU's pass start-up (`pass_start_us`) waits for that host's whole pass start: it
        launches the start-up at its end, where another policy's host has long launched it (runs
        ahead). Seen with the host program on; a Python-step profile keeps it, unverified there."""
        return bool(cpu_experts and self.cpu_pass_start_us)

    def first_mark(self, cpu_experts: bool, chained: bool) -> float:
        """Of a pass's host pass start, the part before its first mark, where layer 0's span starts:
        a CPU-expert policy's books (`cpu_pass_gap_us`, its host the GPU waits for); a synced pass's
        `pass_gap` at the least; a queued pass of another policy's nothing (its host runs ahead)."""
        own = min(self.cpu_pass_gap_us, self.cpu_pass_start_us) if self.startup_after_host(cpu_experts) else 0.0
        return own if chained else max(own, self.pass_gap)

    def host_layer(self, tokens: int) -> float:
        return _host_term(self.host_layer_points, self.host_layer_us, self.host_attn_us_per_token, tokens)

    def host_route(self, tokens: int) -> float:
        return _host_term(self.host_route_points, self.host_route_us, self.host_route_us_per_token, tokens)

    def host_expert(self, tokens: int) -> float:
        return _host_term(self.host_expert_points, self.host_expert_us, self.host_expert_us_per_token, tokens)


def _host_term(points: tuple, one_us: float, per_token_us: float, tokens: int) -> float:
    """A host step at `tokens` rows: its measured table (`HOST_POINTS`) where calibrate fitted one,
    else the line from its one-token time."""
    return table_us(points, tokens) if points else one_us + per_token_us * max(tokens - 1, 0)
