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
  has landed (the executor synchronises the device between passes). With `profile.copy_on_host`
  (the executor on a CPU) the host thread does each copy itself before it goes on.
- CPU worker: fallback experts run one after another on the host after it has issued the GPU
  experts, between the two halves of the GPU->CPU->GPU round trip; the layer ends when both the
  GPU experts and the CPU results are done.
Op times come from the HardwareProfile; sizes from the trace's exact expert bytes. A GPU op that
(attention or an expert) that
starts while a copy is in flight runs `copy_compute_slowdown` slower (the copy's HBM traffic).
What counts as a hit, a stall or a load is `cmoe.core.metrics`'s, shared with the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from cmoe.core.hw import HardwareProfile
from cmoe.core.metrics import RunRecord, classify
from cmoe.policy.policies import Load, Policy
from cmoe.core.quant import format_bits
from cmoe.trace.passes import Pass

_RANK = {"demand": 0, "commit": 1, "prefetch": 2, "admit": 3}


class _Slot:
    __slots__ = ("pending", "writes", "free_at", "waiting")

    def __init__(self):
        self.pending, self.writes, self.free_at, self.waiting = 0, 0, 0.0, []


@dataclass
class Costs:
    """Per-model constants the compute process needs, precomputed once."""
    expert_bytes: list[list[int]]             # [M][E]
    expert_bits: list[list[float]]            # [M][E]
    expert_params: int
    attn_bytes: int                           # resident weights read per decoder layer
    dense_bytes: int                          # one dense (non-MoE) MLP
    shared_bytes: int
    dense_bits: float
    moe_layers: tuple[int, ...]


@dataclass
class SimRun(RunRecord):
    log: list[tuple] = field(default_factory=list)                              # (t, what, layer, slot, expert)


class _NoSpans(list):
    """Where no timeline is asked for: spans are dropped as they come (memory flat in trace length)."""

    def append(self, span) -> None:
        pass


class Simulation:
    def __init__(self, policy: Policy, profile: HardwareProfile, costs: Costs, passes: list[Pass],
                 record_log: bool = False, keep_spans: bool = True):
        self.policy, self.hw, self.c, self.passes = policy, profile, costs, passes
        self.env = simpy.Environment()
        self.queue = simpy.Store(self.env) if profile.copy_fifo else simpy.PriorityStore(self.env)
        self.in_flight = 0                     # loads issued and not landed
        self.queued_us = 0.0                   # link time of the issued loads no engine has started
        self.link_busy_until = 0.0             # when the copies now moving will have landed
        self.drained: simpy.Event | None = None
        self.pass_index = 0
        self.slots = [[_Slot() for _ in range(n)] for n in policy.layout.slots]
        self.ready: dict[tuple[int, int], simpy.Event] = {}
        self.run = SimRun() if keep_spans or record_log else SimRun(spans=_NoSpans())
        self.record_log = record_log
        self.seq = 0
        self.landed_at: dict = {}                         # (layer, expert) -> when its latest copy landed
        for i in range(profile.copy_engines):
            self.env.process(self._copy_engine(f"copy{i}"))
        self.env.process(self._compute())

    # loads ------------------------------------------------------------------------------------
    def _issue(self, ld: Load, pass_idx: int) -> float:
        """Queue a load; returns the host time issuing it costs (the whole copy where the host
        copies itself, as the executor does on a CPU)."""
        self.ready[(ld.layer, ld.expert)] = self.env.event()
        self.seq += 1
        self.in_flight += 1
        nbytes = self.c.expert_bytes[ld.layer][ld.expert]
        self.run.loaded(pass_idx, nbytes)
        self.queued_us += self.hw.h2d_us(nbytes)
        cost = self.hw.host_load_us
        if self.hw.copy_on_host:
            cost += self.hw.h2d_us(nbytes)
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

    def _release(self, st: _Slot) -> None:
        if st.pending == 0 and st.writes == 0 and st.waiting:
            st.writes += 1
            self.queue.put(st.waiting.pop(0))

    def _copy_engine(self, name: str):
        env, hw, run = self.env, self.hw, self.run
        while True:
            item = yield self.queue.get()
            ld: Load = item if hw.copy_fifo else item.item
            st = self.slots[ld.layer][ld.slot]
            if st.free_at > env.now:
                yield env.timeout(st.free_at - env.now)
            nbytes = self.c.expert_bytes[ld.layer][ld.expert]
            start = env.now
            dur = hw.h2d_us(nbytes)
            self.queued_us -= dur
            self.link_busy_until = max(self.link_busy_until, start + dur)
            yield env.timeout(dur)
            run.spans.append(("sim", self.pass_index, self.c.moe_layers[ld.layer], name, "load", ld.expert,
                              start, env.now, nbytes))
            if self.record_log:
                run.log.append((start, "load_start", ld.layer, ld.slot, ld.expert))
                run.log.append((env.now, "load_end", ld.layer, ld.slot, ld.expert))
            self.ready[(ld.layer, ld.expert)].succeed()
            self.landed_at[(ld.layer, ld.expert)] = env.now
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

    def _ahead_layer(self, ps, m: int, d: int, plan, votes, H: float, G: float, t_in: float, route_host: float,
                     slow: float):
        """commit's layer when its experts run before its read-back (`commit_ahead`): the host
        issues the experts (its clock Hx), then waits for the read-back and routes, then issues the
        next layer's loads; the experts wait only for their own copies. Leaves (H, G) in _ahead_out."""
        env, hw, c, run = self.env, self.hw, self.c, self.run
        n = ps.num_tokens
        all_rows = n <= hw.dense_rows
        rows_of = {e: (n if all_rows else votes.get(e, 1)) for e in plan.gpu}
        Hx = H
        Hr = max(H + sum(hw.host_expert(rows_of[e]) for e in plan.gpu), t_in) + route_host
        for ld in plan.loads:                    # layer m+1's: they touch no slot this layer reads
            if Hr > env.now:
                yield env.timeout(Hr - env.now)
            Hr += self._issue(ld, ps.index)
        if Hx > t_in:
            self._span(ps.index, d, "compute", "route", -1, t_in, Hx)
        for e in plan.gpu:
            due = max(G, Hx)
            landed = yield from self._await_copy(m, e, due)
            kind, wait = classify(False, landed, due)
            run.ran(ps.index, kind, wait)
            start = due + wait
            issue = hw.host_expert(rows_of[e])
            dur = hw.expert_us(c.expert_bytes[m][e], c.expert_bits[m][e], rows_of[e], c.expert_params)
            if self.in_flight and self._copying(start):
                dur *= slow
            G = max(start + dur, Hx + issue - hw.host_expert_tail_us)
            Hx += issue
            self._span(ps.index, d, "compute", "expert", e, start, G, c.expert_bytes[m][e])
            st = self.slots[m][plan.slots[e]]
            st.free_at = max(st.free_at, G)
            if self.record_log:
                run.log.append((start, "read_start", m, plan.slots[e], e))
                run.log.append((G, "read_end", m, plan.slots[e], e))
        self._ahead_out = (Hr, G)

    def _copying(self, t: float) -> bool:
        """Will a copy be moving when an op starts at `t`? Queued copies are taken to follow the
        moving ones back to back (slot waits aside), spread over the copy engines."""
        busy = max(self.link_busy_until, self.env.now) + self.queued_us / self.hw.copy_engines
        return t < busy

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
        env, hw, c, pol, run = self.env, self.hw, self.c, self.policy, self.run
        M = len(c.moe_layers)
        fifo = hw.copy_fifo
        predict_us = hw.predict_layer_us if pol.uses_prediction else 0.0
        silent = hw.silent_upper and pol.holds_all     # no host step between attention and experts
        H = G = prev_end = 0.0
        for ps in self.passes:
            if self.in_flight:                   # the device is synchronised between passes, copies included
                self.drained = env.event()
                yield self.drained
            H = max(H, G, env.now)
            yield from self._sync(H)
            self.pass_index = ps.index
            tally = run.at(ps.index)
            slow = 1.0 + hw.copy_compute_slowdown
            n = ps.num_tokens
            layer_gpu = hw.layer_us(n, c.attn_bytes) + hw.attn_us_per_ctx_token * ps.context
            layer_host = hw.host_layer(n)
            route_host = hw.host_sync_us + hw.host_route(n) + predict_us
            commit_decode = ps.decode and pol.commits
            if commit_decode:
                route_host += hw.commit_route_us
            all_rows = n <= hw.dense_rows                         # every expert runs on all the pass's rows
            last = H
            # embedding, masks, the pass's first sync: counted with layer 0's attention
            H, G = self._op(H, G, hw.host_pass_start_us, hw.pass_start_us)
            if commit_decode:                          # layer 0's prediction is read back before it runs
                H = max(H, G) + hw.host_sync_us
                yield from self._sync(H)
            for ld in pol.begin_pass(ps.decode, list(ps.predicted[0])):
                yield from self._sync(H)
                H += self._issue(ld, ps.index)
            prev_layer = -1
            for m in range(M):
                d = c.moe_layers[m]
                for dense in range(prev_layer + 1, d):           # dense decoder layers before this one
                    H, G = self._op(H, G, layer_host + hw.host_expert(n),
                                    layer_gpu + hw.expert_us(c.dense_bytes, c.dense_bits, n, c.dense_bytes))
                    self._span(ps.index, dense, "compute", "dense", -1, last, G)
                    last = G
                prev_layer = d
                gpu, host = layer_gpu, layer_host
                if c.shared_bytes:
                    gpu += hw.expert_us(c.shared_bytes, c.dense_bits, n, c.shared_bytes)
                    host += hw.host_expert(n)
                if self.in_flight and self._copying(max(G, H)):
                    gpu *= slow
                G = max(max(G, H) + gpu, H + host)          # self._op, inlined: the hot path
                H += host
                self._span(ps.index, d, "compute", "attention", -1, last, G)
                t_in = G
                ahead = hw.commit_ahead and commit_decode and fifo
                nxt = list(ps.predicted[m + 1]) if m + 1 < M else None
                plan = pol.plan(m, list(ps.needed[m]), nxt)
                votes = dict(zip(ps.needed[m], ps.votes[m]))
                tally.fallbacks += len(plan.cpu)
                tally.skipped += len(plan.skipped)
                if ahead:
                    # the committed experts are launched first, then the host reads the layer back
                    # and issues the next layer's loads while they run
                    yield from self._ahead_layer(ps, m, d, plan, votes, H, G, t_in, route_host, slow)
                    H, G = self._ahead_out
                    last = max(G, H)
                    continue
                # the routing read-back waits for the GPU; then reading, planning, issuing loads
                if not silent:
                    H = max(H, G) + route_host
                later: dict[int, list[Load]] = {}
                now_loads = plan.loads
                loaded = {ld.expert for ld in plan.loads if ld.layer == m}
                if fifo:                      # a victim this layer still reads: its load waits behind its kernel
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
                for ld in now_loads:
                    if H > env.now:
                        yield env.timeout(H - env.now)
                    H += self._issue(ld, ps.index)
                if plan.cpu:                  # the hidden states go to the host first (first half of the trip)
                    self._span(ps.index, d, "cpu", "roundtrip", -1, H, H + hw.roundtrip_us / 2)
                    H += hw.roundtrip_us / 2
                if H > t_in:
                    self._span(ps.index, d, "compute", "route", -1, t_in, H)
                for e in plan.gpu:
                    due = max(G, H)
                    landed = yield from self._await_copy(m, e, due)
                    kind, wait = classify(e in loaded, landed, due)
                    run.ran(ps.index, kind, wait)
                    start = due + wait
                    rows = n if all_rows else votes.get(e, 1)
                    issue = 0.0 if silent else hw.host_expert(rows)
                    dur = hw.expert_us(c.expert_bytes[m][e], c.expert_bits[m][e], rows, c.expert_params)
                    if self.in_flight and self._copying(start):
                        dur *= slow
                    G = max(start + dur, H + issue - hw.host_expert_tail_us)     # the end mark precedes the tail
                    H += issue
                    self._span(ps.index, d, "compute", "expert", e, start, G, c.expert_bytes[m][e])
                    st = self.slots[m][plan.slots[e]]
                    st.free_at = max(st.free_at, G)
                    if self.record_log:
                        run.log.append((start, "read_start", m, plan.slots[e], e))
                        run.log.append((G, "read_end", m, plan.slots[e], e))
                    if fifo:
                        for ld in later.pop(e, ()):
                            yield from self._sync(H)
                            H += self._issue(ld, ps.index)
                    else:
                        st.pending -= e not in loaded
                        self._release(st)
                if plan.cpu:
                    # the host runs them once it has issued the GPU experts, then sends the results back
                    cpu_t = H
                    for e in plan.cpu:
                        dur = hw.cpu_expert_us(c.expert_bytes[m][e], votes.get(e, 1))
                        self._span(ps.index, d, "cpu", "cpu_expert", e, cpu_t, cpu_t + dur, c.expert_bytes[m][e])
                        cpu_t += dur
                    self._span(ps.index, d, "cpu", "roundtrip", -1, cpu_t, cpu_t + hw.roundtrip_us / 2)
                    H = cpu_t + hw.roundtrip_us / 2
                    if H > G:                 # the GPU waits for the CPU's results
                        tally.stall_us += H - G
                        G = H
                last = max(G, H)
            H, G = self._op(H, G, hw.host_head_us, hw.head_us)
            if hw.head_us or hw.host_head_us:
                self._span(ps.index, -1, "compute", "head", -1, last, G)
            H = max(H, G)                           # the host waits for the logits
            yield from self._sync(H)
            run.pass_us.append((ps.index, ps.decode, n, G - prev_end))
            prev_end = G
            run.occupancy.append(pol.pool.occupancy())

    def simulate(self) -> SimRun:
        self.env.run()
        self.run.spans.sort(key=lambda s: (s[6], s[7], s[3]))       # canonical order: by start, end, stream
        return self.run


def costs_for(trace, spec, rec) -> Costs:
    from cmoe.core.quant import matrix_bytes, non_expert_bytes
    ne = non_expert_bytes(spec, rec)
    fmts = [rec.expert_formats(spec.num_experts, m) for m in range(spec.num_moe_layers)]
    dense = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.dense_ffn).values()) if spec.dense_ffn else 0
    shared = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.shared_ffn).values()) if spec.shared_ffn else 0
    return Costs(expert_bytes=trace.expert_bytes, expert_bits=[[format_bits(f) for f in row] for row in fmts],
                 expert_params=3 * spec.hidden * spec.expert_ffn,
                 attn_bytes=(ne["attention"] + ne["norms"]) // spec.num_layers,
                 dense_bytes=dense, shared_bytes=shared,
                 dense_bits=format_bits(rec.dense), moe_layers=spec.moe_layers)
