"""One simulation as one library call, and the metrics it reports."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cmoe.core.errors import CmoeError
from cmoe.core.hw import HardwareProfile
from cmoe.core.metrics import summary
from cmoe.core.padding import padding_table
from cmoe.policy.budget import expert_budget
from cmoe.policy.policies import make_policy
from cmoe.policy.pool import PoolLayout, layout_for_policy
from cmoe.sim.engine import SimRun, Simulation, costs_for
from cmoe.sim.priced import check_cpu_layer
from cmoe.trace.bundle import Trace, fingerprint
from cmoe.trace.pass_arrays import Future, PassArrays, build, to_passes
from cmoe.trace.passes import check_predictions, popularity

ENGINES = ("replay", "simpy")   # the compiled replay (cmoe.sim.replay), or the SimPy model of record


@dataclass(frozen=True)
class SimConfig:
    policy: str = "commit"
    pool_gb: float = 20.0
    batch: int = 1
    include_prefill: bool = True
    slots: int | None = None          # pin the slots per block instead of deriving them from pool_gb
    groups: int | None = None         # replay only the first groups of `batch` requests ...
    decode_steps: int | None = None   # ... and at most this many decode steps each (what the executor runs)
    engine: str = "replay"            # replay: the same spans and metrics as simpy, ~26x faster (BENCHMARKS.md)
    python_step: bool = False         # the executor's Python step plans the layers (its host program off)


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
    from cmoe.core.quant import format_bits
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
    budget = expert_budget(spec, trace.recipe, int(cfg.pool_gb * 1e9), cfg.batch, trace.cache_slots)
    return layout_for_policy(cfg.policy, trace.slot_bytes, spec.num_experts, spec.top_k, budget["expert_bytes"],
                             cfg.slots), budget


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise CmoeError(f"unknown engine '{engine}': choose replay (fast, the same results) or simpy")


_CACHE: list = []           # the last few (trace, key, value): passes and per-trace constants, most recent last


def _cached(trace: Trace, key: tuple, make):
    for t, k, v in _CACHE:
        if t is trace and k == key:
            return v
    v = make()
    _CACHE[:] = [*_CACHE[-7:], (trace, key, v)]
    return v


def clear_cache() -> None:
    """Forget the passes and per-trace constants (benchmarks time whole calls)."""
    _CACHE.clear()


def passes_for(trace: Trace, cfg: SimConfig) -> PassArrays:
    """The trace's passes for cfg, built once per trace and batch (policies of a run share them)."""
    key = (cfg.batch, cfg.include_prefill, cfg.groups, cfg.decode_steps)
    return _cached(trace, ("passes", *key), lambda: build(trace, *key))


def _facts(trace: Trace) -> tuple:
    """What a run needs of the trace whatever its settings: (popularity, Costs, padding table)."""
    return _cached(trace, ("facts",), lambda: (popularity(trace), costs_for(trace, trace.spec, trace.recipe),
                                              padding_table(trace.expert_bytes)))


@functools.cache
def _have_numba() -> bool:
    import importlib.util
    return importlib.util.find_spec("numba") is not None


def simulate(trace: Trace, profile: HardwareProfile, cfg: SimConfig, record_log: bool = False,
             timeline: bool = True) -> SimResult:
    """One policy on one trace. `timeline=False`: no spans are kept (metrics only; memory stays
    flat in trace length)."""
    check_engine(cfg.engine)
    check_compatible(trace, profile, cfg.pool_gb)
    check_cpu_layer(profile, cfg.policy)
    check_predictions(trace, [cfg.policy])
    layout, budget = layout_for(trace, cfg)
    pa = passes_for(trace, cfg)
    pop, costs, _ = _facts(trace)
    if cfg.python_step:                                 # the Python step's host costs (`python_step`)
        profile = profile.python_step()
    if cfg.engine == "simpy" or not _have_numba():      # the GPU image has no numba: same results, slower
        passes = to_passes(pa)
        policy = make_policy(cfg.policy, layout, trace.spec.num_experts, pop, [p.needed for p in passes])
        run = Simulation(policy, profile, costs, passes, record_log, keep_spans=timeline).simulate()
    else:
        from cmoe.sim.replay import Replay
        policy = make_policy(cfg.policy, layout, trace.spec.num_experts, pop, Future(pa))
        run = Replay(policy, profile, costs, pa, record_log, keep_spans=timeline).simulate()
    return SimResult(cfg, layout, budget, run, metrics(trace, layout, run, cfg, profile))


def metrics(trace: Trace, layout: PoolLayout, run: SimRun, cfg: SimConfig, profile: HardwareProfile) -> dict:
    pads = _facts(trace)[2]
    waste = sum(p.waste_bytes * n / p.num_experts for p, n in zip(pads, layout.slots))
    return {
        "policy": cfg.policy, "pool_gb": cfg.pool_gb, "batch": cfg.batch, "model": trace.spec.name,
        "trace_id": fingerprint(trace), **summary(run),
        "experts_fit": layout.total_slots, "padding_waste_bytes": int(waste),
        "pool_expert_bytes": layout.used_bytes,
        # the OpenMP settings (wait policy, binding) its CPU experts were priced under
        # (`cmoe.executor.omp_wait`; None: unrecorded), which validate holds to the runs'
        "omp_wait_policy": profile.omp_wait_policy or None,
        "cpu_pages": profile.cpu_pages or None,        # and the pages they sat on (`cmoe.core.hugepages`)
        "few_experts": profile.few_experts or None,    # the launches' few-expert switch (`few_experts`)
        "cpu_ref_us": profile.cpu_ref_us or None,      # the host CPU's plain loop at calibration (`cpu_ref`)
    }
