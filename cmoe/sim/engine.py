"""The SimPy model: a host thread, a GPU compute stream, the H2D copy engine(s) and a CPU worker,
replaying a trace under one policy. Scenario: experts live in pinned host memory; the GPU pool
holds a policy-chosen subset in padded slots; for every pass and MoE layer the host issues
attention and the router, reads the routing back, asks the policy for a plan, issues its loads,
then issues each planned expert, which the GPU runs as soon as its copy has landed, while
fallback experts run on the CPU.

Two clocks, as in an eager PyTorch program (the executor is one):
- `H`, the host thread: it pays `host_*` times to issue work and never waits for the GPU except
  at the routing read-back (and at the end of a pass);
- `G`, the compute stream: an op ends at max(max(G, issue start) + its GPU time, host issue end),
  so a host slower than the GPU (eager transformers code) sets the pace, and a GPU waiting for a
  load lets the host run ahead and queue the next layer's attention, which then runs at GPU speed.
A mark (a span's edge) lands where the executor's CUDA event would: max(G, H) when recorded.
The host's route step (`host_route`, not the read-back, the prediction or commit's extra) after a
read-back wait of w takes host_wake(w) / host_wake_base(tokens) times its calibrated cost: a host
runs slower after a long wait (`cmoe.calibrate.wake`). A load's own host cost is not scaled: it
is calibrated in a run that loads, whose waits are long already.
With every `host_*` time 0 (the built-in profiles: a lean decoder whose host keeps ahead) this
is one compute clock, as before.

Processes and resources:
- `compute`: one generator per run walks passes and layers. Ops that need no waiting are summed
  arithmetically and the clock is advanced in one timeout, so an all-hits layer costs one event.
- `copy engines`: `profile.copy_engines` generators. With `profile.copy_fifo` (the executor: one
  copy stream) loads run in issue order and a load whose slot an expert of the same layer still
  reads is issued right after that expert; otherwise one PriorityStore ordered by (pass, layer,
  demand before prefetch, issue order): loads needed soonest go first, and a load into a slot is
  queued only once no planned kernel still reads the slot and no earlier write to it is pending.
  Either way a copy starts no earlier than the last reader's end. A pass starts once every copy
  has landed (the executor synchronises the device between passes), except a decode pass after a
  decode pass under `pass_overlap` (the lean executor's queued graphs), which waits for nothing.
  With `profile.copy_on_host` (the executor on a CPU) the host thread does each copy itself
  before it goes on.
- CPU worker: fallback experts run one after another on the host after it has issued the GPU
  experts, between the two halves of the GPU->CPU->GPU round trip; the layer ends when both the
  GPU experts and the CPU results are done.
Op times come from the HardwareProfile (`cmoe.sim.costs` works out what a model and a pass need of
it); sizes from the trace's exact expert bytes. A GPU op that starts while a copy is in flight runs
slower: an expert by `copy_compute_slowdown`, a layer's attention side by `copy_attention_slowdown`
(`HardwareProfile.attention_slow`).
What counts as a hit, a stall or a load is `cmoe.core.metrics`'s, shared with the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from cmoe.core.hw import HardwareProfile
from cmoe.core.metrics import RunRecord
from cmoe.policy.policies import Load, Policy
from cmoe.sim.costs import Costs, PassCosts, costs_for, moe_attention_extra_us, routers, silent, wake_extra
from cmoe.sim.experts import ExpertSteps
from cmoe.trace.passes import Pass
from cmoe.core.timeline import STREAM, START, END

__all__ = ["Costs", "SimRun", "Simulation", "costs_for"]     # Costs and costs_for live in cmoe.sim.costs

_RANK = {"demand": 0, "commit": 1, "prefetch": 2, "admit": 3}


class _Slot:
    __slots__ = ("pending", "writes", "free_at", "waiting")

    def __init__(self):
        self.pending, self.writes, self.free_at, self.waiting = 0, 0, 0.0, []


@dataclass
class SimRun(RunRecord):
    log: list[tuple] = field(default_factory=list)                              # (t, what, layer, slot, expert)


class _NoSpans(list):
    """Where no timeline is asked for: spans are dropped as they come (memory flat in trace length)."""

    def append(self, _span) -> None:
        pass


class Simulation(ExpertSteps):
    def __init__(self, policy: Policy, profile: HardwareProfile, costs: Costs, passes: list[Pass],
                 record_log: bool = False, keep_spans: bool = True):
        self.policy, self.hw, self.c, self.passes = policy, profile, costs, passes
        self.env = simpy.Environment()
        self.queue = simpy.Store(self.env) if profile.copy_fifo else simpy.PriorityStore(self.env)
        self.in_flight = 0                     # loads issued and not landed
        self.queued_us = 0.0                   # link time of the issued loads no engine has started
        self.link_busy_until = 0.0             # when the copies now moving will have landed
        self.drained: simpy.Event | None = None
        self.pass_index, self.last_wait = 0, 0.0   # last_wait: the pass's latest read-back wait (`_begin_pass`)
        self.slots = [[_Slot() for _ in range(n)] for n in policy.layout.slots]
        self.ready: dict[tuple[int, int], simpy.Event] = {}
        self.run = SimRun() if keep_spans or record_log else SimRun(spans=_NoSpans())
        self.record_log = record_log
        self.seq = 0
        self.landed_at: dict = {}                         # (layer, expert) -> when its latest copy landed
        self._cpu_end = float("-inf")                     # when the last CPU expert ended (`cpu_wake_us`)
        self._copy_us: dict[int, tuple[float, float]] = {}  # bytes -> (alone, queued) us (`_link_us`)
        for i in range(profile.copy_engines):
            self.env.process(self._copy_engine(f"copy{i}"))
        self.env.process(self._compute())

    # loads ------------------------------------------------------------------------------------
    def _issue(self, ld: Load, pass_idx: int, planned: bool = False) -> float:
        """Queue a load; returns the host time issuing it costs: `host_load_us` (unless `planned`:
        the caller paid it before the copy, as a layer's own plan does) and the whole copy where
        the host copies itself, as the executor does on a CPU."""
        self.ready[(ld.layer, ld.expert)] = self.env.event()
        self.seq += 1
        self.in_flight += 1
        nbytes = self.c.expert_bytes[ld.layer][ld.expert]
        self.run.loaded(pass_idx, nbytes)
        alone = self._link_us(nbytes)[0]
        self.queued_us += alone
        cost = 0.0 if planned else self.hw.host_load_us
        if self.hw.copy_on_host:
            cost += alone
        if self.hw.copy_fifo:
            self.queue.put(ld)
            return cost
        item = simpy.PriorityItem((pass_idx, ld.layer, _RANK[ld.kind], self.seq), ld)
        st = self.slots[ld.layer][ld.slot]
        if st.pending == 0 and st.writes == 0:
            st.writes += 1
            self.queue.put(item)
        else:
            st.waiting.append(item)
        return cost

    def _link_us(self, nbytes: int) -> tuple[float, float]:
        """A copy's us alone and queued behind another (`h2d_us`, `h2d_queued`), once a size: every
        load asks at its issue and at its start."""
        got = self._copy_us.get(nbytes)
        if got is None:
            got = self._copy_us[nbytes] = (self.hw.h2d_us(nbytes), self.hw.h2d_queued(nbytes))
        return got

    def _release(self, st: _Slot) -> None:
        if st.pending == 0 and st.writes == 0 and st.waiting:
            st.writes += 1
            self.queue.put(st.waiting.pop(0))

    def _copy_engine(self, name: str):
        env, hw, run = self.env, self.hw, self.run
        last = -1.0                              # when this engine's latest copy landed
        while True:
            item = yield self.queue.get()
            ld: Load = item if hw.copy_fifo else item.item
            st = self.slots[ld.layer][ld.slot]
            if st.free_at > env.now:
                yield env.timeout(st.free_at - env.now)
            nbytes = self.c.expert_bytes[ld.layer][ld.expert]
            start = env.now
            alone, queued = self._link_us(nbytes)
            dur = queued if start == last else alone     # straight on from the last: no start-up
            self.queued_us -= alone
            self.link_busy_until = max(self.link_busy_until, start + dur)
            yield env.timeout(dur)
            run.spans.append(("sim", self.pass_index, self.c.moe_layers[ld.layer], name, "load", ld.expert,
                              start, env.now, nbytes))
            if self.record_log:
                run.log.append((start, "load_start", ld.layer, ld.slot, ld.expert))
                run.log.append((env.now, "load_end", ld.layer, ld.slot, ld.expert))
            self.ready[(ld.layer, ld.expert)].succeed()
            self.landed_at[(ld.layer, ld.expert)] = last = env.now
            self.in_flight -= 1
            if self.in_flight == 0 and self.drained is not None:
                self.drained.succeed()
                self.drained = None
            if not hw.copy_fifo:
                st.writes -= 1
                self._release(st)

    # compute ----------------------------------------------------------------------------------
    def _await_copy(self, m: int, e: int, due: float):
        """The kernel of (m, e) is due at `due`: wait for the copy still pending for it, if any.
        Returns when that copy landed, or None when none was pending at `due`. A copy that landed
        between `due` and now (the host was ahead of the stream: `commit_ahead`) is found by its
        landing time; on the read-back-first path the clock never passes `due` before this."""
        env = self.env
        ev = self.ready.get((m, e))
        if ev is not None and not ev.triggered and due > env.now:
            yield env.timeout(due - env.now)     # the copy may land before the kernel is due
        if ev is not None and not ev.triggered:
            yield ev
            return env.now
        if ev is not None and self.landed_at.get((m, e), -1.0) > due:
            return self.landed_at[(m, e)]
        return None

    def _copying(self, t: float) -> bool:
        """Will a copy be moving when an op starts at `t`? Queued copies are taken to follow the
        moving ones back to back (slot waits aside), spread over the copy engines."""
        busy = max(self.link_busy_until, self.env.now) + self.queued_us / self.hw.copy_engines
        return t < busy

    def _start_copy(self, t: float) -> float:
        """What a pass's GPU start-up beginning at `t` takes more beside a moving load (only a queued
        pass has one: a synced pass waited for every copy): `start_copy_us`. The loads this pass's
        own start issues come after it here; in the executor they could go first where the GPU is
        behind its host, which is not priced. On the thirty-fifth session's `oracle` runs the passes
        whose layer 0 began beside a load were 301 measured against 304 predicted (12 runs)."""
        return self.hw.start_copy_us if self.hw.start_copy_us and self.in_flight and self._copying(t) else 0.0

    def _span(self, p: int, layer: int, stream: str, op: str, expert: int, start: float, end: float, nbytes: int = 0):
        self.run.spans.append(("sim", p, layer, stream, op, expert, start, end, nbytes))

    def _sync(self, clock: float):
        if clock > self.env.now:
            yield self.env.timeout(clock - self.env.now)

    @staticmethod
    def _op(H: float, G: float, host: float, gpu: float) -> tuple[float, float]:
        """The host spends `host` issuing work the GPU needs `gpu` for: new (H, G)."""
        H2 = H + host
        return H2, max(max(G, H) + gpu, H2)

    def _compute(self):
        """The compute process: each pass in turn (its start, then every MoE layer after the dense
        layers before it: its attention and router, then its experts; then the LM head), on the
        host's clock H and the compute stream's G."""
        c, hw, pol, run = self.c, self.hw, self.policy, self.run
        self._M = len(c.moe_layers)
        self._predict_us = hw.predict_layer_us * routers(pol, self._M)
        self._silent = silent(hw, pol)
        moe_gpu = moe_attention_extra_us(hw, pol, self._M)
        H = G = prev_end = 0.0
        queued = False                               # the last pass ended with no host wait (`pass_overlap`)
        for ps in self.passes:
            chained = queued and ps.decode
            queued = hw.pass_overlap and ps.decode
            x, H, G, last = yield from self._begin_pass(ps, H, G, chained)
            n, p = x.n, x.p
            prev_layer = -1
            for m, d in enumerate(c.moe_layers):
                if d > prev_layer + 1:                   # dense decoder layers before this one
                    H, G, last = self._dense_layers(x, prev_layer + 1, d, H, G, last)
                prev_layer = d
                gpu, host = x.layer_gpu + moe_gpu, x.layer_host     # the read-back's packing, the prediction
                if c.shared_bytes:
                    gpu += hw.expert_us(c.shared_bytes, c.dense_bits, n, c.shared_bytes)
                    host += hw.host_expert(n)
                if self.in_flight and self._copying(max(G, H)):
                    gpu *= x.attn_slow
                G = max(max(G, H) + gpu, H + host)          # self._op, inlined: the hot path
                H += host
                run.spans.append(("sim", p, d, "compute", "attention", -1, last, G, 0))     # self._span
                H, G = yield from self._moe_layer(x, m, d, H, G)
                last = max(G, H)
            H, G = self._op(H, G, hw.host_head_us, hw.head_us)
            if hw.head_us or hw.host_head_us:
                self._span(p, -1, "compute", "head", -1, last, G)
            # the host waits for the logits; a queued pass, only for the pass before it (its books)
            H = max(H, prev_end) if queued else max(H, G)
            yield from self._sync(H)
            run.pass_us.append((p, ps.decode, n, G - prev_end))
            prev_end = G
            run.occupancy.append(pol.pool.occupancy())

    def _begin_pass(self, ps: Pass, H: float, G: float, chained: bool = False):
        """A pass's start: wait for every copy to land (the device is synchronised between
        passes), work out the pass's per-layer costs, run its start-up (embedding, masks, its first
        sync: counted with layer 0's attention, whose span starts after the host's `pass_gap_us`, where
        the executor's first mark lands; a CPU-expert policy's GPU start-up after its host's whole
        pass start, `startup_after_host`) and issue the policy's loads for the pass. A `chained`
        pass (`pass_overlap`) waits for nothing: the host goes on from its own clock (not from
        `env.now`, where this process last waited to learn when a copy lands: the executor's host
        had issued that kernel and the head long before), copies stay in flight, and its first mark
        lands when the GPU gets to it. Returns (the pass's costs, H, G,
        where layer 0's attention span starts)."""
        env, hw, pol = self.env, self.hw, self.policy
        if self.in_flight and not chained:   # the device is synchronised between passes, copies included
            self.drained = env.event()
            yield self.drained
        H = H if chained else max(H, G, env.now)
        yield from self._sync(H)
        self.pass_index = ps.index
        x = PassCosts(ps, self.run.at(ps.index), hw, self.c, pol.commits, self._predict_us)
        gap = hw.first_mark(pol.cpu_experts, chained)   # the pass's first mark, past the host's books
        last = max(G, H + gap) if chained else H + gap
        if hw.startup_after_host(pol.cpu_experts):
            H += hw.host_pass_start(pol.cpu_experts)
            G = max(G, H) + hw.pass_start_us + self._start_copy(max(G, H))
        else:                                   # slower after a long pass, or one whose last wait was long
            before = self.run.pass_us[-1] if self.run.pass_us else (0, False, 0, 0.0)
            extra = hw.pass_start_extras_us(before[3], self.last_wait) if before[1] else 0.0
            H, G = self._op(H, G, hw.host_pass_start(pol.cpu_experts) + extra,
                            hw.pass_start_us + self._start_copy(max(G, H)))
        self.last_wait = 0.0
        if x.commit_decode:                        # layer 0's prediction is read back and planned before it runs
            H = max(H, G) + hw.host_sync_us + hw.commit_start_us
            yield from self._sync(H)
        deep = {"ahead": ps.seen(0, pol.depth)} if pol.depth > 1 else {}
        for ld in pol.begin_pass(ps.decode, list(ps.predicted[0]), **deep):
            yield from self._sync(H)
            H += self._issue(ld, ps.index)
        return x, H, G, last

    def _dense_layers(self, x: PassCosts, first: int, end: int, H: float, G: float, last: float):
        """The dense (non-MoE) decoder layers `first` to `end` - 1, all arithmetic: one clock step
        each, a span from `last`. Returns (H, G, where the next span starts)."""
        hw, c, n = self.hw, self.c, x.n
        for dense in range(first, end):
            H, G = self._op(H, G, x.layer_host + hw.host_expert(n),
                            x.layer_gpu + hw.expert_us(c.dense_bytes, c.dense_bits, n, c.dense_bytes))
            self._span(x.p, dense, "compute", "dense", -1, last, G)
            last = G
        return H, G, last

    def _moe_layer(self, x: PassCosts, m: int, d: int, H: float, G: float):
        """MoE layer m (decoder layer d) once its router has run: the policy's plan; then either
        commit's experts ahead of the read-back (`_ahead_layer`), or the routing read-back (it waits
        for the GPU), the loads, the GPU experts as their copies land and the CPU fallbacks.
        Returns (H, G)."""
        env, hw, ps = self.env, self.hw, x.ps
        t_in = G
        nxt = list(ps.predicted[m + 1]) if m + 1 < self._M else None
        deep = {"ahead": ps.seen(m + 1, self.policy.depth)} if self.policy.depth > 1 else {}
        plan = self.policy.plan(m, list(ps.needed[m]), nxt, **deep)
        votes = dict(zip(ps.needed[m], ps.votes[m]))
        x.tally.fallbacks += len(plan.cpu)
        x.tally.skipped += len(plan.skipped)
        if x.ahead:
            return (yield from self._ahead_layer(x, m, d, plan, votes, H, G))
        if not self._silent:          # the route step, slower after a long wait and beside a load
            self.last_wait = max(G - H, 0.0)
            H = max(H, G) + x.route_host + wake_extra(hw, x, self.last_wait) \
                + (hw.readback_copy_us if hw.readback_copy_us and self.in_flight and self._copying(t_in) else 0.0)
        later: dict[int, list[Load]] = {}
        now_loads = plan.loads
        loaded = {ld.expert for ld in plan.loads if ld.layer == m}
        if x.fifo:                    # a victim this layer still reads: its load waits behind its kernel
            now_loads, gpu_set = [], set(plan.gpu)
            for ld in plan.loads:
                if ld.layer == m and ld.victim in gpu_set:
                    later.setdefault(ld.victim, []).append(ld)
                else:
                    now_loads.append(ld)
        else:
            for e in plan.gpu:        # reads of resident experts; a loaded one is read after its write
                if e not in loaded:
                    self.slots[m][plan.slots[e]].pending += 1
        for ld in now_loads:          # each load's host cost (its slot, its victim) comes before its copy
            H += hw.host_load_us
            if H > env.now:
                yield env.timeout(H - env.now)
            H += self._issue(ld, x.p, planned=True)
        if plan.cpu:                  # the hidden states go to the host first (first half of the trip)
            self._span(x.p, d, "cpu", "roundtrip", -1, H, H + x.half_rt)
            H += x.half_rt
        if H > t_in:
            self._span(x.p, d, "compute", "route", -1, t_in, H)
        H, G = yield from self._gpu_experts(x, m, d, plan, votes, loaded, later, H, G, self._silent,
                                             table=0.0 if self._silent else hw.launch_copy_us)
        if plan.cpu:
            H, G = self._cpu_experts(x, m, d, plan, votes, H, G)
        return H, G

    def _ahead_layer(self, x: PassCosts, m: int, d: int, plan, votes: dict, H: float, G: float):
        """commit's layer when its experts run before its read-back (`commit_ahead`): the host
        issues the experts (its clock Hx), then waits for the read-back and routes, then issues the
        next layer's loads while they run; the experts wait only for their own copies, and on the
        stream for `commit_gpu_us` of copies between the attention and the launch (and
        `commit_gpu_copy_us` more when a load is moving then: they queue behind it). Returns (H, G)."""
        env, hw = self.env, self.hw
        t_in = G
        rows_of = {e: (x.n if x.all_rows else votes.get(e, 1)) for e in plan.gpu}
        Hx = H
        moving = bool(hw.commit_gpu_copy_us and self.in_flight and self._copying(max(G, Hx)))
        if hw.wave_gbps:                         # one launch, issued once
            issued = hw.host_expert(x.n) if plan.gpu else 0.0      # by the pass's tokens
        else:
            issued = sum(hw.host_expert(rows_of[e]) for e in plan.gpu)
        self.last_wait = max(t_in - (H + issued), 0.0)
        Hr = max(H + issued, t_in) + x.route_host + wake_extra(hw, x, self.last_wait)
        for ld in plan.loads:                    # layer m+1's: they touch no slot this layer reads
            if Hr > env.now:
                yield env.timeout(Hr - env.now)
            Hr += self._issue(ld, x.p)
        end = Hx
        if hw.commit_gpu_us or moving:           # the read-back's start and the launch's inputs, on the stream
            G = max(G, Hx) + hw.commit_gpu_us + (hw.commit_gpu_copy_us if moving else 0.0)
            end = max(Hx, G)
        if end > t_in:
            self._span(x.p, d, "compute", "route", -1, t_in, end)
        _, G = yield from self._gpu_experts(x, m, d, plan, votes, set(), {}, Hx, G, False, hw.owa_gpu_us)
        return Hr, G

    def simulate(self) -> SimRun:
        self.env.run()
        self.run.spans.sort(key=lambda s: (s[START], s[END], s[STREAM]))       # canonical order: by start, end, stream
        return self.run
