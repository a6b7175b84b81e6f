"""One simulation as one library call, and the metrics it reports."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from cmoe.errors import CmoeError
from cmoe.hw import HardwareProfile
from cmoe.padding import padding_table
from cmoe.policy.budget import expert_budget
from cmoe.policy.policies import make_policy
from cmoe.policy.pool import PoolLayout, plan_layout
from cmoe.sim.engine import SimRun, Simulation, costs_for
from cmoe.trace.bundle import Trace, fingerprint
from cmoe.trace.passes import make_passes, popularity
from cmoe.util import percentile


@dataclass(frozen=True)
class SimConfig:
    policy: str = "commit"
    pool_gb: float = 20.0
    batch: int = 1
    include_prefill: bool = True
    slots: int | None = None          # pin the slots per block instead of deriving them from pool_gb


@dataclass
class SimResult:
    config: SimConfig
    layout: PoolLayout
    budget: dict
    run: SimRun
    metrics: dict

    def policy_json(self, trace: Trace, profile: HardwareProfile) -> dict:
        """What the executor reads to run the same policy."""
        return {"format": "cmoe-policy", "format_version": 1, "policy": self.config.policy,
                "pool_gb": self.config.pool_gb, "batch": self.config.batch, "model": trace.spec.name,
                "quant": trace.recipe.to_dict(), "profile": profile.name,
                "layout": {"slot_bytes": list(self.layout.slot_bytes), "slots": list(self.layout.slots)},
                "budget": self.budget}


def check_compatible(trace: Trace, profile: HardwareProfile, pool_gb: float) -> None:
    from cmoe.quant import format_bits
    have = dict(profile.expert_gbps)
    fmts = {trace.recipe.expert, trace.recipe.dense, *(f for f, _ in trace.recipe.mixed)}
    for f in fmts:
        b = format_bits(f)
        cls = "int4" if b <= 4 else "int8" if b <= 8 else "bf16"
        if cls not in have:
            raise CmoeError(f"hardware profile {profile.name} has no expert kernel speed for {cls} weights "
                            f"({f} in {trace.spec.name}'s recipe): add it to expert_gbps")
    if not 0 < pool_gb < 10_000:
        raise CmoeError(f"--pool-gb {pool_gb:g} is absurd: give the GPU memory for the model in GB, e.g. 20")
    if pool_gb * 1e9 > profile.gpu_mem_bytes:
        raise CmoeError(f"a {pool_gb:g} GB pool does not fit the {profile.name}'s "
                        f"{profile.gpu_mem_bytes / 1e9:.1f} GB of GPU memory: lower --pool-gb")


def layout_for(trace: Trace, cfg: SimConfig) -> tuple[PoolLayout, dict]:
    spec = trace.spec
    max_len = int(trace.step.max()) + 1 if trace.num_tokens else 1
    budget = expert_budget(spec, trace.recipe, int(cfg.pool_gb * 1e9), cfg.batch, max_len)
    if cfg.policy == "upper":
        return PoolLayout(tuple(trace.slot_bytes), (spec.num_experts,) * spec.num_moe_layers,
                          sum(trace.slot_bytes) * spec.num_experts), budget
    if cfg.slots is not None:
        if not spec.top_k <= cfg.slots <= spec.num_experts:
            raise CmoeError(f"--slots must lie between top_k ({spec.top_k}) and the expert count ({spec.num_experts})")
        n = (cfg.slots,) * spec.num_moe_layers
        return PoolLayout(tuple(trace.slot_bytes), n, sum(a * b for a, b in zip(trace.slot_bytes, n))), budget
    return plan_layout(trace.slot_bytes, spec.num_experts, budget["expert_bytes"], spec.top_k), budget


def simulate(trace: Trace, profile: HardwareProfile, cfg: SimConfig, record_log: bool = False) -> SimResult:
    check_compatible(trace, profile, cfg.pool_gb)
    layout, budget = layout_for(trace, cfg)
    passes = make_passes(trace, cfg.batch, cfg.include_prefill)
    policy = make_policy(cfg.policy, layout, trace.spec.num_experts, popularity(trace))
    run = Simulation(policy, profile, costs_for(trace, trace.spec, trace.recipe), passes, record_log).simulate()
    return SimResult(cfg, layout, budget, run, metrics(trace, layout, run, cfg))


def metrics(trace: Trace, layout: PoolLayout, run: SimRun, cfg: SimConfig) -> dict:
    dec = [(n, us) for _, d, n, us in run.pass_us if d]
    pre = [(n, us) for _, d, n, us in run.pass_us if not d]
    dec_tokens, dec_us = sum(n for n, _ in dec), sum(us for _, us in dec)
    lat = [us for _, us in dec]
    pads = padding_table(trace.expert_bytes)
    waste = sum(p.waste_bytes * n / p.num_experts for p, n in zip(pads, layout.slots))
    return {
        "policy": cfg.policy, "pool_gb": cfg.pool_gb, "batch": cfg.batch, "model": trace.spec.name,
        "trace_id": fingerprint(trace),
        "tokens_per_s": dec_tokens / dec_us * 1e6 if dec_us else float("nan"),
        "tpot_ms_mean": statistics.fmean(lat) / 1e3 if lat else float("nan"),
        "tpot_ms_p50": percentile(lat, 0.5) / 1e3, "tpot_ms_p99": percentile(lat, 0.99) / 1e3,
        "prefill_ms": sum(us for _, us in pre) / 1e3, "decode_tokens": dec_tokens,
        "stall_ms": run.stall_us / 1e3, "bytes_moved": run.bytes_moved, "loads": run.loads,
        "hit_rate": run.hits / (run.gpu_experts + run.fallbacks) if run.gpu_experts + run.fallbacks else 1.0, "fallbacks": run.fallbacks,
        "skipped": run.skipped, "mean_occupancy": statistics.fmean(run.occupancy) if run.occupancy else 0,
        "experts_fit": layout.total_slots, "padding_waste_bytes": int(waste),
        "pool_expert_bytes": layout.used_bytes,
    }
