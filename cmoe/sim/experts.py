"""A MoE layer's experts in the SimPy model (`cmoe.sim.engine.Simulation`, of which this is a
mixin): the GPU experts one kernel each, or in the lean executor's fused launches (waves), and
the CPU fallbacks. Each step takes and returns the host's clock H and the compute stream's G,
as `Simulation._moe_layer` does; `cmoe.sim.replay.compute` is the compiled twin, line for line.
"""

from __future__ import annotations

from cmoe.core.metrics import classify
from cmoe.policy.policies import Load
from cmoe.policy.waves import waves
from cmoe.sim.costs import PassCosts


class ExpertSteps:
    def _gpu_experts(self, x: PassCosts, m: int, d: int, plan, votes: dict, loaded: set[int],
                     later: dict[int, list[Load]], H: float, G: float, silent: bool, extra: float = 0.0,
                     table: float = 0.0):
        """The plan's GPU experts in turn: each kernel once its copy (if one is pending) has landed
        and the host has issued it (nothing to issue when `silent`), slowed while a copy moves.
        `loaded`: the experts this layer loads itself. With one FIFO copy stream, `later`'s loads
        are issued right after the kernel of the expert whose slot they overwrite; with the
        priority queue, a kernel's end releases its slot to the loads waiting for it. Returns
        (H, G)."""
        hw, c, run, p = self.hw, self.c, self.run, x.p
        if hw.wave_gbps:
            return (yield from self._gpu_waves(x, m, d, plan, votes, loaded, later, H, G, silent, extra, table))
        ready, landed_at = self.ready, self.landed_at
        for e in plan.gpu:
            due = max(G, H)
            ev = ready.get((m, e))
            if ev is None or (ev.triggered and landed_at.get((m, e), -1.0) <= due):
                landed = None         # what _await_copy would say at once: no copy to wait for or to count
            else:
                landed = yield from self._await_copy(m, e, due)
            kind, wait = classify(e in loaded, landed, due)
            run.ran(p, kind, wait)
            start = due + wait
            rows = x.n if x.all_rows else votes.get(e, 1)
            issue = 0.0 if silent else hw.host_expert(rows)
            dur = hw.expert_us(c.expert_bytes[m][e], c.expert_bits[m][e], rows, c.expert_params)
            if self.in_flight and self._copying(start):
                dur *= x.slow
            G = max(start + dur, H + issue - hw.host_expert_tail_us)     # the end mark precedes the tail
            H += issue
            run.spans.append(("sim", p, d, "compute", "expert", e, start, G, c.expert_bytes[m][e]))   # self._span
            st = self.slots[m][plan.slots[e]]
            st.free_at = max(st.free_at, G)
            if self.record_log:
                run.log.append((start, "read_start", m, plan.slots[e], e))
                run.log.append((G, "read_end", m, plan.slots[e], e))
            if x.fifo:
                for ld in later.pop(e, ()):
                    yield from self._sync(H)
                    H += self._issue(ld, p)
            else:
                st.pending -= e not in loaded
                self._release(st)
        return H, G

    def _gpu_waves(self, x: PassCosts, m: int, d: int, plan, votes: dict, loaded: set[int],
                   later: dict[int, list[Load]], H: float, G: float, silent: bool, extra: float = 0.0,
                   table: float = 0.0):
        """The lean executor's fused launches (`profile.wave_gbps`): the plan's GPU experts in
        waves (`cmoe.policy.waves`, as the executor groups them); a wave starts once all its copies
        have landed (each expert's wait counted from the same due time, as the executor's events
        do) and the host has done its part of the issue before the launch (the slot table, the
        waits, the launch itself: all but host_expert_tail_us; the GPU idles meanwhile, as the
        H200's timelines show: 40-60 us between the read-back and a layer's first expert), runs
        wave_us (+ `extra`: commit's OWA) plus its experts' shares, and its time is split evenly among them (the executor's
        spans); the loads deferred behind a wave's experts are issued after it. One that starts while a
        copy moves is slowed as `HardwareProfile.wave_beside_copy` says. A launch issued while a
        load moves starts `table` later (the read-back path's `launch_copy_us`: its slot table's small
        copy, on the compute stream, waits behind the load's on the one H2D engine; on the H200, 2026-12-05,
        6 us between the read-back and the experts with the link idle, 16-25 us beside a load).
        Copies run FIFO (the profile requires it). Returns (H, G)."""
        hw, c, run, p = self.hw, self.c, self.run, x.p
        after = {ld.expert: v for v, lds in later.items() for ld in lds}
        for wave in waves(plan.gpu, after):
            due = max(G, H)
            start, dur = due, hw.wave_fixed_us(len(wave)) + extra
            for e in wave:
                ev = self.ready.get((m, e))
                if ev is None or (ev.triggered and self.landed_at.get((m, e), -1.0) <= due):
                    landed = None
                else:
                    landed = yield from self._await_copy(m, e, due)
                kind, wait = classify(e in loaded, landed, due)
                run.ran(p, kind, wait)
                start = max(start, due + wait)
                r = x.n if x.all_rows else votes.get(e, 1)
                dur += hw.wave_expert_us(c.expert_bytes[m][e], r)
            issue = 0.0 if silent else hw.host_expert(x.n)   # by the pass's tokens, as calibrate measures it
            launched = H + issue - hw.host_expert_tail_us       # launched once the host is through
            if table and self.in_flight and self._copying(launched):
                launched += table
            start = max(start, launched)
            if self.in_flight and self._copying(start):
                dur = hw.wave_beside_copy(dur, extra)
            G = start + dur
            H += issue
            step = (G - start) / len(wave)
            for j, e in enumerate(wave):
                a, b = start + j * step, (G if j == len(wave) - 1 else start + (j + 1) * step)
                run.spans.append(("sim", p, d, "compute", "expert", e, a, b, c.expert_bytes[m][e]))
                st = self.slots[m][plan.slots[e]]
                st.free_at = max(st.free_at, G)
                if self.record_log:                  # the spans' edges, as the replay logs them
                    run.log.append((a, "read_start", m, plan.slots[e], e))
                    run.log.append((b, "read_end", m, plan.slots[e], e))
            for e in wave:
                for ld in later.pop(e, ()):
                    yield from self._sync(H)
                    H += self._issue(ld, p)
        return H, G

    def _cpu_experts(self, x: PassCosts, m: int, d: int, plan, votes: dict, H: float, G: float):
        """The fallback experts: once it has issued the GPU experts the host sets them up
        (`cpu_lead_us`), runs them one after another (`cpu_gap_us` between two), then sends the
        results back (the trip's second half), which the GPU waits for (a stall), and adds them
        in (`cpu_tail_us`, the host's alone). Returns (H, G)."""
        hw, c = self.hw, self.c
        cpu_t = H + hw.cpu_lead_us
        for k, e in enumerate(plan.cpu):
            cpu_t += hw.cpu_gap_us if k else 0.0
            dur = hw.cpu_expert_us(c.expert_bytes[m][e], votes.get(e, 1))
            dur = dur + hw.cpu_wake_us(cpu_t - self._cpu_end)       # longer after the CPU idled
            self._span(x.p, d, "cpu", "cpu_expert", e, cpu_t, cpu_t + dur, c.expert_bytes[m][e])
            cpu_t += dur
            self._cpu_end = cpu_t
        self._span(x.p, d, "cpu", "roundtrip", -1, cpu_t, cpu_t + x.half_rt)
        H = cpu_t + x.half_rt
        if H > G:                 # the GPU waits for the CPU's results
            x.tally.stall_us += H - G
            G = H
        return H + hw.cpu_tail_us, G
