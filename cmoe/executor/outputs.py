"""What a measured run reports and leaves behind: its metrics (`cmoe.core.metrics.summary`'s
figures, which the simulator reports too, plus the measured run's own), the run folder `cmoe
execute` writes, and its table. Apart from `cmoe.executor.run`, which prepares, builds and runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cmoe.core.metrics import summary
from cmoe.core.timeline import BYTES, END, OP, START, STEP
from cmoe.executor.omp_wait import in_force
from cmoe.executor.records import RunLog
from cmoe.policy.pool import PoolLayout
from cmoe.trace.bundle import fingerprint

if TYPE_CHECKING:
    from cmoe.executor.run import ExecConfig, ExecResult, Workload


def metrics(log: RunLog, w: Workload, cfg: ExecConfig, policy: str, layout: PoolLayout) -> dict:
    """`summary`'s figures, plus a measured run's own: the copies' bandwidth, a decode pass's time by op."""
    dec_passes = {p for p, d, _, _ in log.pass_us if d}
    by_op: dict[str, float] = {}
    for s in log.spans:
        if s[STEP] in dec_passes:
            by_op[s[OP]] = by_op.get(s[OP], 0.0) + (s[END] - s[START])
    loads = [s for s in log.spans if s[OP] == "load"]
    load_us = sum(s[END] - s[START] for s in loads)
    n_dec = max(len(dec_passes), 1)
    return {
        "source": "gpu" if w.device.type == "cuda" else "cpu", "policy": policy, "pool_gb": cfg.pool_gb,
        "batch": cfg.batch, "model": w.spec.name, "expert_format": w.fmt,
        "trace_id": fingerprint(w.trace) if w.trace is not None else None,
        "device": torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu",
        **summary(log),
        "h2d_gbps": sum(s[BYTES] for s in loads) / load_us / 1e3 if load_us else float("nan"),
        "engine": cfg.engine,
        # which calls timed and ordered the device work: the CUDA runtime's, torch's (the runtime
        # was not found), or none (the CPU); and the timing events the run made late (its reserve used up)
        "host_calls": log.host_calls, "late_events": log.late_events,
        # whether its graphed decode passes ran the compiled host program (`cmoe.executor.lean_fast`)
        "host_program": log.host_program,
        # the CPU experts' speed depends on their OpenMP settings and pages (`omp_wait`, `cmoe.core.hugepages`)
        "omp_wait_policy": in_force(), "cpu_pages": w.store.cpu_pages(),
        # the few-expert thresholds its graphs were captured under (`cmoe.executor.few_experts`; None:
        # no launch could switch: the CPU, the reference engine, `upper`, `commit`, no wave graphs)
        "few_experts": log.few_experts,
        # the core the passes' thread was held on (`CMOE_PIN_HOST`, `cmoe.executor.affinity`; None: free)
        "host_core": log.host_core,
        # the host CPU's plain loop right before and after the passes, us (`cmoe.core.cpu_ref`)
        "cpu_ref_us": list(log.cpu_ref_us) or None,
        # first-request cost: warm-up and CUDA-graph capture on the first decode pass (lean, CUDA)
        "capture_ms": (getattr(log, "capture_us", None) or 0.0) / 1e3,
        "expert_ms_per_pass": by_op.get("expert", 0.0) / n_dec / 1e3,
        "outside_experts_ms_per_pass": (by_op.get("attention", 0.0) + by_op.get("head", 0.0)) / n_dec / 1e3,
        "route_ms_per_pass": by_op.get("route", 0.0) / n_dec / 1e3,
        "cpu_expert_ms_per_pass": by_op.get("cpu_expert", 0.0) / n_dec / 1e3,
        "experts_fit": layout.total_slots, "pool_expert_bytes": layout.used_bytes,
    }


def write_outputs(out: Path, results: list[ExecResult], force: bool = False) -> None:
    """The run folder, built whole under a temporary name and renamed into place (`force`: replace
    an existing run folder whole)."""
    from cmoe.report.chrome import write_chrome_trace
    from cmoe.report.passes import write_passes
    from cmoe.analysis.runfolder import MARKER
    from cmoe.core.timeline import write_parquet
    from cmoe.core.util import atomic_dir, write_text_atomic
    with atomic_dir(out, force, MARKER) as tmp:
        for r in results:
            write_parquet(r.log.spans, tmp / f"timeline-{r.policy}.parquet")
            write_chrome_trace(r.log.spans, tmp / f"timeline-{r.policy}.json")
            write_passes(r.log.pass_rows(), tmp / f"passes-{r.policy}.json")
        write_text_atomic(tmp / "metrics.json", json.dumps([r.metrics for r in results], indent=1))


def table(results: list[ExecResult]) -> str:
    from cmoe.report.table import policy_table
    return policy_table([r.metrics for r in results])
