"""`Replay`: the SimPy model's results without SimPy. Same constructor and result as
`cmoe.sim.engine.Simulation` (a `SimRun`: spans, per-pass figures, occupancy, the slot log),
the same policy object, the same costs; passes as `PassArrays` (or a list of `Pass`).

No policy reads the clock, so a run is a fixed schedule: the passes are cut into chunks; for
each, the policy's decisions are made first (its compiled twin, `decide.py`, or the object's own
`plan` for a class without one), then the clock replays them (`compute.py` over `clock.py`).
Memory: with `keep_spans=False` a run holds its per-pass figures and one chunk's decisions, so
it stays flat in trace length; spans, when kept, are columns until the end.
"""

from __future__ import annotations

import numpy as np

from cmoe.core.hw import HardwareProfile
from cmoe.core.metrics import PassCounts
from cmoe.policy.policies import Policy
from cmoe.sim.engine import Costs, SimRun
from cmoe.sim.costs import moe_attention_extra_us, routers, silent
from cmoe.sim.replay import clock as ck
from cmoe.sim.replay.compute import run as run_passes
from cmoe.sim.replay.decide import decide
from cmoe.sim.replay.twin_pool import decisions
from cmoe.sim.replay.spans import Spans
from cmoe.sim.replay.state import decide_python, export, has_twin, pass_data, restore
from cmoe.trace.pass_arrays import PassArrays, from_passes

CHUNK_CELLS = 1 << 16          # (pass, layer, expert) cells of decisions held at once (~7 MB of buffers)


def _scalars(policy: Policy, hw: HardwareProfile) -> np.ndarray:
    """`Costs.hwf`: the profile's scalars the clock reads, in `clock`'s order (SLOW .. COPY_LAUNCH, -1
    for a profile without it: `HardwareProfile.wave_beside_copy`), the pass start and its first mark
    the policy's own (`HardwareProfile.host_pass_start`, `first_mark`: PASS_GAP a synced pass's,
    CHAINED_GAP a queued one's)."""
    cpu = policy.cpu_experts
    return np.array([1.0 + hw.copy_compute_slowdown, hw.host_load_us, hw.host_expert_us, hw.host_expert_us_per_token,
                     hw.host_expert_tail_us, hw.matmul_tflops * 1e12, hw.host_sync_us, hw.pass_start_us,
                     hw.host_pass_start(cpu), hw.head_us, hw.host_head_us, float(hw.wave_gbps > 0), hw.wave_row_us,
                     hw.owa_gpu_us, hw.first_mark(cpu, False), hw.commit_gpu_us, hw.commit_gpu_copy_us,
                     hw.commit_start_us, hw.attention_slow, hw.readback_copy_us, hw.launch_copy_us, hw.cpu_lead_us,
                     hw.cpu_gap_us, hw.cpu_tail_us, hw.first_mark(cpu, True), float(hw.startup_after_host(cpu)),
                     hw.start_copy_us, -1.0 if hw.copy_launch_us is None else hw.copy_launch_us])


def cost_tables(policy: Policy, hw: HardwareProfile, c: Costs, pa: PassArrays, keep_spans: bool) -> ck.Costs:
    """Every cost the clock reads, computed with the profile's own methods (per distinct size and
    token count), so the arithmetic is the SimPy model's."""
    M, E = len(c.moe_layers), policy.E
    h2d, h2dq, xfix, eb = *(np.zeros((M, E)) for _ in range(3)), np.zeros((M, E), np.int64)
    memo: dict = {}
    for m in range(M):
        for e in range(E):
            b, bits = c.expert_bytes[m][e], c.expert_bits[m][e]
            if (b, bits) not in memo:
                memo[b, bits] = (hw.h2d_us(b), hw.h2d_queued(b), hw.expert_us(b, bits, 1, c.expert_params))
            h2d[m, e], h2dq[m, e], xfix[m, e] = memo[b, bits]
            eb[m, e] = b
    # an expert's kernel, a CPU expert and the issue by rows, from the profile's own methods (lines
    # or measured tables alike), for every row count a pass can give an expert
    R = int(pa.ntok.max()) if pa.ntok.size else 1
    keys = sorted(memo)
    xcls = np.array([[keys.index((c.expert_bytes[m][e], c.expert_bits[m][e])) for e in range(E)] for m in range(M)],
                    np.int64).reshape(M, E)
    xtab = np.array([[hw.expert_us(b, bits, max(r, 1), c.expert_params) for r in range(R + 1)] for b, bits in keys])
    # the host's issue: one expert's kernel by its rows, or a fused launch (once for all its
    # experts) by the pass's tokens, as calibrate measures it; both index 1..R
    htab = np.array([hw.host_expert(max(r, 1)) for r in range(R + 1)])
    wfix = eb / (hw.wave_gbps * 1e9) * 1e6 if hw.wave_gbps else np.zeros((M, E))
    wcnt = np.array([hw.wave_fixed_us(k) for k in range(E + 1)])     # a launch's own cost by its experts
    ns, inv = np.unique(pa.ntok, return_inverse=True)
    predict = hw.predict_layer_us * routers(policy, M)
    per_n = np.array([[hw.layer_us(n, c.attn_bytes), hw.host_layer(n), hw.host_sync_us + hw.host_route(n) + predict,
                       hw.host_expert(n),
                       hw.expert_us(c.dense_bytes, c.dense_bits, n, c.dense_bytes) if c.dense_bytes else 0.0,
                       hw.expert_us(c.shared_bytes, c.dense_bits, n, c.shared_bytes) if c.shared_bytes else 0.0,
                       hw.host_route(n), hw.host_wake_base(n), hw.roundtrip(n) / 2]
                      for n in ns.tolist()]).reshape(-1, 9)[inv]
    layer_gpu = per_n[:, 0] + hw.attn_us_per_ctx_token * pa.context + hw.attn_us_per_cache_key * np.where(pa.decode, pa.keys, pa.context) \
        + np.where(pa.decode, hw.attn_split_us(c.cache_len), 0.0)
    layer_host = per_n[:, 1]
    commit_decode = pa.decode & policy.commits
    route_host = per_n[:, 2].copy()
    route_host[commit_decode] += hw.commit_route_us
    dense_host, dense_gpu = layer_host + per_n[:, 3], layer_gpu + per_n[:, 4]
    attn_gpu = layer_gpu + moe_attention_extra_us(hw, policy, M)
    if c.shared_bytes:
        attn_gpu = attn_gpu + per_n[:, 5]
    attn_host = layer_host + per_n[:, 3] if c.shared_bytes else layer_host
    hwf = _scalars(policy, hw)
    hwi = np.array([hw.copy_engines, hw.copy_fifo, hw.copy_on_host, c.expert_params, keep_spans,
                    bool(hw.head_us or hw.host_head_us), silent(hw, policy),
                    hw.commit_ahead and policy.commits and hw.copy_fifo], np.int64)
    c_ = np.ascontiguousarray                    # one array type everywhere: numba compiles once
    return ck.Costs(h2d, h2dq, xfix, eb, c_([[hw.cpu_expert_us(b, max(r, 1)) for r in range(R + 1)] for b, _ in keys]),
                    np.array(c.moe_layers, np.int64), hwf, hwi, c_(layer_gpu), c_(layer_host), c_(route_host), c_(dense_gpu),
                    c_(dense_host), c_(attn_gpu), c_(attn_host), c_(pa.ntok), c_(pa.decode), c_(commit_decode),
                    c_(pa.decode & bool(hw.pass_overlap)), c_(pa.ntok <= hw.dense_rows), c_(pa.need_ptr), c_(pa.need),
                    c_(pa.votes), c_(xtab), c_(xcls), c_(htab), c_(wfix), c_(wcnt),
                    np.array(hw.host_wake_points or ((0.0, 1.0),), np.float64).reshape(-1, 2), c_(per_n[:, 6]),
                    c_(per_n[:, 7]), np.array(hw.cpu_wake_points or ((0.0, 0.0),), np.float64).reshape(-1, 2), c_(per_n[:, 8]),
                    np.array(hw.host_pass_start_points or ((0.0, 0.0),), np.float64).reshape(-1, 2),
                    np.array(hw.host_boundary_points or ((0.0, 0.0),), np.float64).reshape(-1, 2))


class Replay:
    def __init__(self, policy: Policy, profile: HardwareProfile, costs: Costs, passes, record_log: bool = False,
                 keep_spans: bool = True):
        self.policy, self.hw, self.c = policy, profile, costs
        self.pa = passes if isinstance(passes, PassArrays) else from_passes(passes, len(costs.moe_layers))
        self.record_log, self.keep = record_log, keep_spans or record_log

    def simulate(self) -> SimRun:
        pa, pol, M = self.pa, self.policy, len(self.c.moe_layers)
        P, E = pa.num_passes, pol.E
        x = cost_tables(pol, self.hw, self.c, pa, self.keep)
        c = ck.new_clock(M, E, max(pol.layout.slots), self.hw.copy_engines, (M + 1) * 2 * E + 16)
        out = ck.new_out(0, P)
        spans = Spans(self.hw.copy_engines, self.keep)
        ck.start(c, x, out)
        twin = has_twin(pol)
        st, pd = (export(pol, pa), pass_data(pa)) if twin else (None, None)
        chunk = max(1, CHUNK_CELLS // ((M + 1) * E))
        d = decisions(min(chunk, P) * (M + 1), min(chunk, P), E)
        occupancy = np.zeros(P, np.int64)
        for p0 in range(0, P, chunk):
            p1 = min(P, p0 + chunk)
            if twin:
                decide(st, d, pd, p0, p1, P)
            else:
                decide_python(pol, pa, d, p0, p1)
            occupancy[p0:p1] = d.occupancy[:p1 - p0]
            cap = (p1 - p0) * (4 * M + max(self.c.moe_layers) + 3) + int(d.n[0] + d.n[1] + d.n[2] + c.I[ck.IN_FLIGHT]) + 8
            o = spans.buffer(out, cap)
            c.I[ck.NSPAN] = 0
            run_passes(c, x, o, d, p0, p1, M)
            self._check(c)
            spans.keep_chunk(o, int(c.I[ck.NSPAN]))
        o = spans.buffer(out, int(c.I[ck.IN_FLIGHT]) + 8)
        c.I[ck.NSPAN] = 0
        ck.finish(c, x, o)
        self._check(c)
        spans.keep_chunk(o, int(c.I[ck.NSPAN]))
        if twin:
            restore(pol, st)
        return self._record(out, occupancy, spans)

    @staticmethod
    def _check(c) -> None:
        err = int(c.I[ck.ERR])
        assert err != ck.ERR_TWICE, "a load's ready event triggered twice (the SimPy model fails here too)"
        assert err != ck.ERR_RING, "replay buffers overflowed"

    def _record(self, out, occupancy, spans: Spans) -> SimRun:
        pa = self.pa
        run = SimRun()
        dec, ntok = pa.decode.tolist(), pa.ntok.tolist()
        cols = [getattr(out, f).tolist() for f in ("hits", "late", "demand", "fallbacks", "skipped", "loads",
                                                   "bytes_moved", "stall")]
        run.per_pass = {p: PassCounts(*row) for p, row in enumerate(zip(*cols))}
        run.pass_us = list(zip(range(pa.num_passes), dec, ntok, out.pass_us.tolist()))
        run.occupancy = occupancy.tolist()
        if self.keep:
            run.spans, log = spans.tuples(self.record_log)
            if self.record_log:
                run.log = log
        return run
