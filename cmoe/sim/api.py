"""`cmoe simulate` and `cmoe sweep` as library calls: pick the trace, run policies, write outputs."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from cmoe.errors import CmoeError
from cmoe.hw import HardwareProfile, load_profile
from cmoe.sim.run import SimConfig, SimResult, simulate
from cmoe.trace.bundle import Trace
from cmoe.trace.load import load_trace
from cmoe.util import atomic_dir, write_text_atomic

# Peak memory of a simulation, per token, MoE layer and policy (its spans), measured on the default
# study (1,280 tokens x 32 layers x 6 policies: 0.19 GB, 0.72 GB with --out and its report).
MEM_BYTES = 400
MEM_BYTES_OUT = 2_600
MEM_BASE = 100e6


def run_policies(t: Trace, profile: HardwareProfile, policies: list[str], pool_gb: float, batch: int,
                 slots: int | None = None) -> list[SimResult]:
    return [simulate(t, profile, SimConfig(policy=p, pool_gb=pool_gb, batch=batch, slots=slots)) for p in policies]


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
                f"(fewer requests or decode steps) or fewer --policies")
    return (f"out of memory: simulating {what} needs about {need / 1e9:.1f} GB ({bare / 1e9:.1f} GB without --out): "
            f"simulate a shorter trace (fewer requests or decode steps) or fewer --policies, or drop --out")


def write_outputs(out: Path, t: Trace, profile: HardwareProfile, results: list[SimResult], force: bool = False) -> None:
    """The run folder, built whole under a temporary name and renamed into place (`force`: replace
    an existing run folder whole)."""
    from cmoe.report.chrome import write_chrome_trace
    from cmoe.report.passes import write_passes
    from cmoe.runfolder import MARKER
    from cmoe.timeline import write_parquet
    with atomic_dir(out, force, MARKER) as tmp:
        for r in results:
            name = r.config.policy
            write_parquet(r.run.spans, tmp / f"timeline-{name}.parquet")
            write_chrome_trace(r.run.spans, tmp / f"timeline-{name}.json")
            write_passes(r.run.pass_rows(), tmp / f"passes-{name}.json")
            write_text_atomic(tmp / f"policy-{name}.json", json.dumps(r.policy_json(t, profile), indent=1))
        write_text_atomic(tmp / "metrics.json", json.dumps([r.metrics for r in results], indent=1))


@dataclass(frozen=True)
class SweepPoint:
    trace: str
    profile: str
    pool_gb: float
    policy: str
    batch: int
    quant: str | None


def _run_point(p: SweepPoint) -> dict:
    base = {"trace": p.trace, "profile": p.profile, "pool_gb": p.pool_gb, "policy": p.policy, "batch": p.batch}
    try:
        t = load_trace(p.trace, p.quant, p.batch)
        r = simulate(t, load_profile(p.profile), SimConfig(policy=p.policy, pool_gb=p.pool_gb, batch=p.batch))
        return {**base, **{k: v for k, v in r.metrics.items() if k not in base}, "error": ""}
    except CmoeError as e:
        return {**base, "error": str(e)}
    except MemoryError:
        return {**base, "error": "out of memory: a shorter trace or a smaller batch needs less"}


def sweep(traces: list[str], profiles: list[str], pools: list[float], policies: list[str], batches: list[int],
          quant: str | None, jobs: int, progress: bool = True) -> list[dict]:
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm
    for pr in profiles:
        load_profile(pr)                                    # fail fast on a bad name
    points = [SweepPoint(*x, quant) for x in itertools.product(traces, profiles, pools, policies, batches)]
    if not points:
        raise CmoeError("the sweep's grid is empty: give at least one trace, profile, pool size, policy and batch")
    if jobs <= 1:
        rows = [_run_point(p) for p in tqdm(points, disable=None if progress else True, desc="sweep")]
    else:
        with ProcessPoolExecutor(jobs) as ex:
            rows = list(tqdm(ex.map(_run_point, points), total=len(points), disable=None if progress else True, desc="sweep"))
    return rows


def check_sweep(rows: list[dict]) -> list[dict]:
    """Refuse a sweep none of whose points ran, naming the first point's error; else the rows."""
    if rows and all(r["error"] for r in rows):
        r = rows[0]
        raise CmoeError(f"none of the {len(rows)} grid points could run; the first ({r['trace']}, {r['profile']}, "
                        f"pool {r['pool_gb']:g} GB, {r['policy']}, batch {r['batch']}): {r['error']}")
    return rows


def write_sweep(rows: list[dict], path: Path, force: bool = False) -> Path:
    import polars as pl

    from cmoe.util import atomic_path, check_output
    check_output(path, force)
    with atomic_path(path) as tmp:
        pl.DataFrame(rows, infer_schema_length=None).write_parquet(tmp)
    return path
