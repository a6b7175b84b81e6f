"""`cmoe simulate` as library calls: run policies on a trace, write outputs (`cmoe sweep` is
`cmoe.sweep`)."""

from __future__ import annotations

import json
from pathlib import Path

from cmoe.core.hw import HardwareProfile
from cmoe.sim.run import SimConfig, SimResult, simulate
from cmoe.trace.bundle import Trace
from cmoe.core.util import atomic_dir, write_text_atomic

# Peak memory of a simulation, per token, MoE layer and policy (its spans), measured on the default
# study (1,280 tokens x 32 layers x 6 policies: 0.19 GB, 0.72 GB with --out and its report).
MEM_BYTES = 400
MEM_BYTES_OUT = 2_600
MEM_BASE = 100e6


def run_policies(t: Trace, profile: HardwareProfile, policies: list[str], pool_gb: float, batch: int,
                 slots: int | None = None, engine: str = "replay", timeline: bool = True) -> list[SimResult]:
    """`timeline=False`: metrics only, no spans kept (cmoe simulate without --out)."""
    return [simulate(t, profile, SimConfig(policy=p, pool_gb=pool_gb, batch=batch, slots=slots, engine=engine),
                     timeline=timeline) for p in policies]


def table(results: list[SimResult]) -> str:
    from cmoe.report.table import policy_table
    return policy_table([r.metrics for r in results])


def out_of_memory(t: Trace, policies: int, with_out: bool) -> str:
    """What to tell a user whose simulation ran out of memory: about how much it needs, and how to need less."""
    n = t.num_tokens * t.spec.num_moe_layers * policies
    need, bare = MEM_BASE + n * (MEM_BYTES_OUT if with_out else MEM_BYTES), MEM_BASE + n * MEM_BYTES
    what = (f"{t.num_tokens:,} tokens x {t.spec.num_moe_layers} MoE layers x {policies} "
            f"polic{'y' if policies == 1 else 'ies'}")
    if not with_out:
        return (f"out of memory: simulating {what} needs about {need / 1e9:.1f} GB: simulate a shorter trace "
                f"(fewer requests or decode steps) or fewer --policy names")
    return (f"out of memory: simulating {what} needs about {need / 1e9:.1f} GB ({bare / 1e9:.1f} GB without --out): "
            f"simulate a shorter trace (fewer requests or decode steps) or fewer --policy names, or drop --out")


def write_outputs(out: Path, t: Trace, profile: HardwareProfile, results: list[SimResult], force: bool = False) -> None:
    """The run folder, built whole under a temporary name and renamed into place (`force`: replace
    an existing run folder whole)."""
    from cmoe.report.chrome import write_chrome_trace
    from cmoe.report.passes import write_passes
    from cmoe.analysis.runfolder import MARKER
    from cmoe.core.timeline import write_parquet
    with atomic_dir(out, force, MARKER) as tmp:
        for r in results:
            name = r.config.policy
            write_parquet(r.run.spans, tmp / f"timeline-{name}.parquet")
            write_chrome_trace(r.run.spans, tmp / f"timeline-{name}.json")
            write_passes(r.run.pass_rows(), tmp / f"passes-{name}.json")
            write_text_atomic(tmp / f"policy-{name}.json", json.dumps(r.policy_json(t, profile), indent=1))
        write_text_atomic(tmp / "metrics.json", json.dumps([r.metrics for r in results], indent=1))
