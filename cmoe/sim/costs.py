"""What the simulator needs of a model and of a pass, worked out once: per model, the exact bytes
and bits of every expert and the resident weights a layer reads (`Costs`, from `costs_for`; the
SimPy model `cmoe.sim.engine` and its compiled replay both take it); per pass, what the SimPy
model's layers cost on the GPU and the host (`PassCosts`)."""

from __future__ import annotations

from dataclasses import dataclass

from cmoe.core.hw import HardwareProfile
from cmoe.core.quant import format_bits
from cmoe.trace.passes import Pass


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
    cache_len: int = 0                        # KV-cache slots the executor allocates for the trace
                                              # (`Trace.cache_slots`): what the decode attention's runs are cut by


def costs_for(trace, spec, rec) -> Costs:
    """The Costs of a trace's model under recipe `rec`."""
    from cmoe.core.quant import matrix_bytes, non_expert_bytes
    ne = non_expert_bytes(spec, rec)
    fmts = [rec.expert_formats(spec.num_experts, m) for m in range(spec.num_moe_layers)]
    dense = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.dense_ffn).values()) if spec.dense_ffn else 0
    shared = sum(matrix_bytes(rec.dense, o, i) for o, i in spec.mlp_shapes(spec.shared_ffn).values()) if spec.shared_ffn else 0
    return Costs(expert_bytes=trace.expert_bytes, expert_bits=[[format_bits(f) for f in row] for row in fmts],
                 expert_params=3 * spec.hidden * spec.expert_ffn,
                 attn_bytes=(ne["attention"] + ne["norms"]) // spec.num_layers,
                 dense_bytes=dense, shared_bytes=shared,
                 dense_bits=format_bits(rec.dense), moe_layers=spec.moe_layers,
                 cache_len=trace.cache_slots)


def silent(hw: HardwareProfile, policy) -> bool:
    """No host step between a layer's attention and its experts: the lean executor's `upper`."""
    return hw.silent_upper and policy.holds_all


def routers(policy, num_layers: int) -> float:
    """Early routers a MoE layer runs under `policy`, on average over the layers: the next layer's
    for the policies that predict; a look-ahead policy's the next `depth` layers' (fewer near the
    last layer, as the executor runs them), plus the `depth` it runs at a pass's start on the state
    before layer 0, spread over the pass's layers; 0 for the rest."""
    if not policy.uses_prediction:
        return 0.0
    M, d = num_layers, policy.depth
    return (sum(min(d, M - q) for q in range(1, M)) + min(d, M)) / max(M, 1)


def moe_attention_extra_us(hw: HardwareProfile, policy, num_layers: int) -> float:
    """What a MoE layer's attention gains on the GPU under `policy`: the read-back's packing (every
    policy but a silent upper) and the early routers (the policies that predict)."""
    return (0.0 if silent(hw, policy) else hw.readback_gpu_us) + hw.predict_gpu_us * routers(policy, num_layers)


class PassCosts:
    """What every layer of one pass costs or needs (op times, the host's costs, which path commit
    takes), worked out once per pass; `tally` is the pass's counts in the run record."""
    __slots__ = ("ps", "p", "n", "tally", "slow", "attn_slow", "layer_gpu", "layer_host", "route_host", "route_wake", "wake_base",
                 "half_rt", "commit_decode", "all_rows", "fifo", "ahead")

    def __init__(self, ps: Pass, tally, hw: HardwareProfile, c: Costs, commits: bool, predict_us: float):
        n = ps.num_tokens
        self.ps, self.p, self.n, self.tally = ps, ps.index, n, tally
        self.slow, self.attn_slow = 1.0 + hw.copy_compute_slowdown, hw.attention_slow
        self.layer_gpu = hw.layer_us(n, c.attn_bytes) + hw.attn_us_per_ctx_token * ps.context \
            + hw.attn_us_per_cache_key * (ps.keys if ps.decode else ps.context) \
            + (hw.attn_split_us(c.cache_len) if ps.decode else 0.0)
        self.layer_host = hw.host_layer(n)
        self.route_host = hw.host_sync_us + hw.host_route(n) + predict_us
        # the part a long wait slows (`wake_extra`): the route step as calibrate measured it
        self.route_wake, self.wake_base = hw.host_route(n), hw.host_wake_base(n)
        self.half_rt = hw.roundtrip(n) / 2                         # a CPU layer's round trip, each half
        self.commit_decode = ps.decode and commits
        if self.commit_decode:
            self.route_host += hw.commit_route_us
        self.all_rows = n <= hw.dense_rows                         # every expert runs on all the pass's rows
        self.fifo = hw.copy_fifo
        self.ahead = hw.commit_ahead and self.commit_decode and self.fifo


def wake_extra(hw: HardwareProfile, x: PassCosts, wait_us: float) -> float:
    """What a read-back wait of `wait_us` adds to pass x's route step: the step as measured times
    host_wake(wait) over the factor its measurement held already, less one (0.0 exactly without
    wake points, so such profiles give what they gave before)."""
    return x.route_wake * (hw.host_wake(wait_us) / x.wake_base - 1.0)
