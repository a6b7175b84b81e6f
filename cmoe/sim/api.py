"""`cmoe simulate` and `cmoe sweep` as library calls: pick the trace, run policies, write outputs."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from cmoe.errors import CmoeError
from cmoe.hw import HardwareProfile, load_profile
from cmoe.policy.policies import POLICIES
from cmoe.sim.run import SimConfig, SimResult, simulate
from cmoe.trace.bundle import Trace
from cmoe.trace.load import load_trace
from cmoe.util import write_text_atomic


def parse_policies(text: str | None) -> list[str]:
    names = [p.strip() for p in (text or ",".join(POLICIES)).split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad:
        raise CmoeError(f"unknown policy '{bad[0]}': choose from {', '.join(POLICIES)}")
    return names


def run_policies(t: Trace, profile: HardwareProfile, policies: list[str], pool_gb: float, batch: int,
                 slots: int | None = None) -> list[SimResult]:
    return [simulate(t, profile, SimConfig(policy=p, pool_gb=pool_gb, batch=batch, slots=slots)) for p in policies]


def table(results: list[SimResult]) -> str:
    from cmoe.report.table import policy_table
    return policy_table([r.metrics for r in results])


def write_outputs(out: Path, t: Trace, profile: HardwareProfile, results: list[SimResult]) -> None:
    from cmoe.report.chrome import write_chrome_trace
    from cmoe.report.passes import pass_rows, write_passes
    from cmoe.timeline import write_parquet
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        name = r.config.policy
        write_parquet(r.run.spans, out / f"timeline-{name}.parquet")
        write_chrome_trace(r.run.spans, out / f"timeline-{name}.json")
        write_passes(pass_rows(r.run.pass_us, r.run.occupancy, r.run.pass_hits), out / f"passes-{name}.json")
        write_text_atomic(out / f"policy-{name}.json", json.dumps(r.policy_json(t, profile), indent=1))
    write_text_atomic(out / "metrics.json", json.dumps([r.metrics for r in results], indent=1))


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


def sweep(traces: list[str], profiles: list[str], pools: list[float], policies: list[str], batches: list[int],
          quant: str | None, jobs: int, progress: bool = True) -> list[dict]:
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm
    for pr in profiles:
        load_profile(pr)                                    # fail fast on a bad name
    points = [SweepPoint(*x, quant) for x in itertools.product(traces, profiles, pools, policies, batches)]
    if jobs <= 1:
        rows = [_run_point(p) for p in tqdm(points, disable=not progress, desc="sweep")]
    else:
        with ProcessPoolExecutor(jobs) as ex:
            rows = list(tqdm(ex.map(_run_point, points), total=len(points), disable=not progress, desc="sweep"))
    return rows


def write_sweep(rows: list[dict], path: Path) -> Path:
    import polars as pl

    from cmoe.util import atomic_path
    with atomic_path(path) as tmp:
        pl.DataFrame(rows, infer_schema_length=None).write_parquet(tmp)
    return path
