"""The SimPy model: a GPU compute stream, the H2D copy engine(s) and a CPU worker, replaying a trace
under one policy. Scenario: experts live in pinned host memory; the GPU pool holds a policy-chosen
subset in padded slots; for every pass and MoE layer the compute stream runs attention and the
router, asks the policy for a plan, issues its loads, then computes each planned expert as soon as
its copy has landed, while fallback experts run on the CPU.

Processes and resources:
- `compute`: one generator per run walks passes and layers. Ops that need no waiting are summed
  arithmetically and the clock is advanced in one timeout, so an all-hits layer costs one event.
- `copy engines`: `profile.copy_engines` generators draining one PriorityStore ordered by
  (pass, layer, demand before prefetch, issue order): loads needed soonest go first.
- slots: a load into a slot is queued only once no planned kernel still reads the slot and no
  earlier write to it is pending; the copy then starts no earlier than the last reader's end.
- CPU worker: fallback experts run one after another on the CPU after a GPU->CPU->GPU round
  trip; the layer ends when both the GPU experts and the CPU results are done.
Op times come from the HardwareProfile; sizes from the trace's exact expert bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from cmoe.hw import HardwareProfile
from cmoe.policy.policies import Load, Policy
from cmoe.quant import format_bits
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
class SimRun:
    spans: list[tuple] = field(default_factory=list)
    pass_us: list[tuple[int, bool, int, float]] = field(default_factory=list)   # (pass, decode, tokens, latency)
    log: list[tuple] = field(default_factory=list)                              # (t, what, layer, slot, expert)
    loads: int = 0
    bytes_moved: int = 0
    needed: int = 0
    gpu_experts: int = 0        # experts computed on the GPU
    hits: int = 0               # ... whose weights were already in the pool when the kernel was due
    fallbacks: int = 0
    skipped: int = 0
    stall_us: float = 0.0
    occupancy: list[int] = field(default_factory=list)        # per pass: experts resident at its end
    pass_hits: list[tuple[int, int]] = field(default_factory=list)   # per pass: (hits, experts run)


class Simulation:
    def __init__(self, policy: Policy, profile: HardwareProfile, costs: Costs, passes: list[Pass],
                 record_log: bool = False):
        self.policy, self.hw, self.c, self.passes = policy, profile, costs, passes
        self.env = simpy.Environment()
        self.queue = simpy.PriorityStore(self.env)
        self.slots = [[_Slot() for _ in range(n)] for n in policy.layout.slots]
        self.ready: dict[tuple[int, int], simpy.Event] = {}
        self.run = SimRun()
        self.record_log = record_log
        self.seq = 0
        for i in range(profile.copy_engines):
            self.env.process(self._copy_engine(f"copy{i}"))
        self.env.process(self._compute())

    # loads ------------------------------------------------------------------------------------
    def _issue(self, ld: Load, pass_idx: int) -> None:
        self.ready[(ld.layer, ld.expert)] = self.env.event()
        self.seq += 1
        item = simpy.PriorityItem((pass_idx, ld.layer, _RANK[ld.kind], self.seq), ld)
        st = self.slots[ld.layer][ld.slot]
        if st.pending == 0 and st.writes == 0:
            st.writes += 1
            self.queue.put(item)
        else:
            st.waiting.append(item)

    def _release(self, st: _Slot) -> None:
        if st.pending == 0 and st.writes == 0 and st.waiting:
            st.writes += 1
            self.queue.put(st.waiting.pop(0))

    def _copy_engine(self, name: str):
        env, hw, run = self.env, self.hw, self.run
        while True:
            item = yield self.queue.get()
            ld: Load = item.item
            st = self.slots[ld.layer][ld.slot]
            if st.free_at > env.now:
                yield env.timeout(st.free_at - env.now)
            nbytes = self.c.expert_bytes[ld.layer][ld.expert]
            start = env.now
            yield env.timeout(hw.h2d_us(nbytes))
            run.spans.append(("sim", item.priority[0], self.c.moe_layers[ld.layer], name, "load", ld.expert,
                              start, env.now, nbytes))
            if self.record_log:
                run.log.append((start, "load_start", ld.layer, ld.slot, ld.expert))
                run.log.append((env.now, "load_end", ld.layer, ld.slot, ld.expert))
            run.loads += 1
            run.bytes_moved += nbytes
            self.ready[(ld.layer, ld.expert)].succeed()
            st.writes -= 1
            self._release(st)

    # compute ----------------------------------------------------------------------------------
    def _span(self, p: int, layer: int, stream: str, op: str, expert: int, start: float, end: float, nbytes: int = 0):
        self.run.spans.append(("sim", p, layer, stream, op, expert, start, end, nbytes))

    def _sync(self, clock: float):
        if clock > self.env.now:
            yield self.env.timeout(clock - self.env.now)

    def _compute(self):
        env, hw, c, pol, run = self.env, self.hw, self.c, self.policy, self.run
        M = len(c.moe_layers)
        for ps in self.passes:
            t0 = clock = env.now
            hits0, ran0 = run.hits, run.gpu_experts + run.fallbacks
            n = ps.num_tokens
            for ld in pol.begin_pass(ps.decode, list(ps.predicted[0])):
                self._issue(ld, ps.index)
            if hw.pass_start_us:                 # embedding, masks, the pass's first sync: counted with layer 0
                self._span(ps.index, 0, "compute", "attention", -1, clock, clock + hw.pass_start_us)
                clock += hw.pass_start_us
            prev_layer = -1
            for m in range(M):
                d = c.moe_layers[m]
                for dense in range(prev_layer + 1, d):           # dense decoder layers before this one
                    dur = hw.layer_us(n, c.attn_bytes) + hw.expert_us(c.dense_bytes, c.dense_bits, n, c.dense_bytes)
                    self._span(ps.index, dense, "compute", "dense", -1, clock, clock + dur)
                    clock += dur
                prev_layer = d
                dur = hw.layer_us(n, c.attn_bytes) + (hw.predict_layer_us if pol.uses_prediction else 0.0)
                self._span(ps.index, d, "compute", "attention", -1, clock, clock + dur)
                clock += dur
                if c.shared_bytes:
                    dur = hw.expert_us(c.shared_bytes, c.dense_bits, n, c.shared_bytes)
                    self._span(ps.index, d, "compute", "shared", -1, clock, clock + dur, c.shared_bytes)
                    clock += dur
                nxt = list(ps.predicted[m + 1]) if m + 1 < M else None
                plan = pol.plan(m, list(ps.needed[m]), nxt)
                votes = dict(zip(ps.needed[m], ps.votes[m]))
                run.needed += len(ps.needed[m])
                run.fallbacks += len(plan.cpu)
                run.skipped += len(plan.skipped)
                loaded = {ld.expert for ld in plan.loads if ld.layer == m}
                run.gpu_experts += len(plan.gpu)
                for e in plan.gpu:            # reads of resident experts; a loaded one is read after its write
                    if e not in loaded:
                        self.slots[m][plan.slots[e]].pending += 1
                if plan.loads:
                    yield from self._sync(clock)
                    for ld in plan.loads:
                        self._issue(ld, ps.index)
                route_at = clock
                for e in plan.gpu:
                    ev = self.ready.get((m, e))
                    if ev is not None and not ev.triggered:
                        yield from self._sync(clock)      # the copy may land before the kernel is due
                    if ev is None or ev.triggered:
                        run.hits += 1
                    else:
                        waited = env.now
                        yield ev
                        run.stall_us += env.now - waited
                        clock = env.now
                    tokens = votes.get(e, 1)
                    dur = hw.expert_us(c.expert_bytes[m][e], c.expert_bits[m][e], tokens, c.expert_params)
                    self._span(ps.index, d, "compute", "expert", e, clock, clock + dur, c.expert_bytes[m][e])
                    st = self.slots[m][plan.slots[e]]
                    st.pending -= e not in loaded
                    st.free_at = max(st.free_at, clock + dur)
                    if self.record_log:
                        run.log.append((clock, "read_start", m, plan.slots[e], e))
                        run.log.append((clock + dur, "read_end", m, plan.slots[e], e))
                    clock += dur
                    self._release(st)
                if plan.cpu:
                    # on a GPU the CPU experts overlap the layer's GPU experts; an executor running
                    # on the CPU itself does them after (one set of cores does both)
                    cpu_t = route_at + hw.roundtrip_us
                    self._span(ps.index, d, "cpu", "roundtrip", -1, cpu_t - hw.roundtrip_us, cpu_t)
                    for e in plan.cpu:
                        dur = hw.cpu_expert_us(c.expert_bytes[m][e], votes.get(e, 1))
                        self._span(ps.index, d, "cpu", "cpu_expert", e, cpu_t, cpu_t + dur, c.expert_bytes[m][e])
                        cpu_t += dur
                    if cpu_t > clock:
                        run.stall_us += cpu_t - clock
                        clock = cpu_t
            if hw.head_us:
                self._span(ps.index, -1, "compute", "head", -1, clock, clock + hw.head_us)
                clock += hw.head_us
            yield from self._sync(clock)
            run.pass_us.append((ps.index, ps.decode, n, env.now - t0))
            run.occupancy.append(pol.pool.occupancy())
            run.pass_hits.append((run.hits - hits0, run.gpu_experts + run.fallbacks - ran0))

    def simulate(self) -> SimRun:
        self.env.run()
        self.run.spans.sort(key=lambda s: (s[6], s[7], s[3]))       # canonical order: by start, end, stream
        return self.run


def costs_for(trace, spec, rec) -> Costs:
    from cmoe.quant import matrix_bytes, non_expert_bytes
    ne = non_expert_bytes(spec, rec)
    fmts = [rec.expert_formats(spec.num_experts, m) for m in range(spec.num_moe_layers)]
    dense = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.dense_ffn).values()) if spec.dense_ffn else 0
    shared = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.shared_ffn).values()) if spec.shared_ffn else 0
    return Costs(expert_bytes=trace.expert_bytes, expert_bits=[[format_bits(f) for f in row] for row in fmts],
                 expert_params=3 * spec.hidden * spec.expert_ffn,
                 attn_bytes=(ne["attention"] + ne["norms"]) // spec.num_layers,
                 dense_bytes=dense, shared_bytes=shared,
                 dense_bits=format_bits(rec.dense), moe_layers=spec.moe_layers)
