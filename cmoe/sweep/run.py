"""Running a sweep: each point is one `cmoe.sim.run.simulate` call without a timeline (the
replay by default), on local worker processes or on a Ray cluster, its row streamed to the
table as it finishes. A point never ends the sweep: whatever it raises is kept in its row
(`error`, one line; `traceback` for anything but a CmoeError). Points are sent in small
batches of one trace, so a worker loads each trace once (`_cached`).

Ray (`ray="auto"`: the cluster this machine belongs to if one runs, else a new local one with
`jobs` CPUs; or a cluster's address): one task per batch, at most a few batches per CPU in
flight, results taken as they come. Every node needs cmoe installed.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.sweep.points import SETTINGS, point_id
from cmoe.sweep.table import SweepTable

BATCH_MAX = 16                   # points per task, at most
_TRACES: dict = {}               # per worker process: (trace, quant, requests) -> Trace


@dataclass
class SweepStats:
    points: int                  # in this sweep
    skipped: int                 # already in the table (--resume)
    computed: int                # run now
    failed: int                  # of those, with an error
    path: Path


def _cached(p: dict):
    from cmoe.trace.load import load_trace
    key = (p["trace"], p["quant"], max(4, p["batch"]) if p["trace"].startswith("synthetic:") else 0)
    if key not in _TRACES:
        if len(_TRACES) >= 4:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = load_trace(p["trace"], p["quant"], p["batch"])
    return _TRACES[key]


def run_point(p: dict) -> dict:
    """One point's row: settings, id, metrics, and its error if it could not run."""
    from cmoe.core.hw import load_profile
    from cmoe.sim.run import SimConfig, simulate
    row = {**p, "point_id": point_id(p)}
    t0 = time.perf_counter()
    try:
        cfg = SimConfig(**{k: p[k] for k in ("policy", "pool_gb", "batch", "include_prefill", "slots", "groups",
                                             "decode_steps", "engine")})
        r = simulate(_cached(p), load_profile(p["profile"]), cfg, timeline=False)
        row.update({k: v for k, v in r.metrics.items() if k not in SETTINGS}, error="", traceback="")
    except CmoeError as e:
        row.update(error=str(e), traceback="")
    except MemoryError:
        row.update(error="out of memory: a shorter trace or a smaller batch needs less", traceback="")
    except Exception as e:                          # kept in the row: one point never ends the sweep
        row.update(error=f"{type(e).__name__}: {' '.join(str(e).split())}"[:500], traceback=traceback.format_exc())
    row["wall_s"] = time.perf_counter() - t0
    return row


def run_batch(points: list[dict]) -> list[dict]:
    return [run_point(p) for p in points]


def _batches(points: list[dict], workers: int) -> list[list[dict]]:
    """Points of one trace together, cut so every worker gets several batches."""
    size = max(1, min(BATCH_MAX, len(points) // (4 * max(1, workers)) or 1))
    by_trace: dict = {}
    for p in points:
        by_trace.setdefault((p["trace"], p["quant"], p["batch"]), []).append(p)
    return [g[i:i + size] for g in by_trace.values() for i in range(0, len(g), size)]


def _crashed(batch: list[dict], e: BaseException) -> list[dict]:
    why = f"the worker running this point died ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
    return [{**p, "point_id": point_id(p), "error": why, "traceback": "", "wall_s": 0.0} for p in batch]


def _local(batches: list[list[dict]], jobs: int):
    """Rows as batches finish, on `jobs` worker processes (in this process for one)."""
    if jobs <= 1:
        for b in batches:
            yield from run_batch(b)
        return
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    with ProcessPoolExecutor(jobs) as ex:
        pending = {ex.submit(run_batch, b): b for b in batches}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                b = pending.pop(f)
                try:
                    yield from f.result()
                except Exception as e:             # a worker that died takes its batch's rows with it
                    yield from _crashed(b, e)


def connect_ray(address: str, jobs: int):
    """`auto`: the running cluster this machine belongs to, else a new local one with `jobs` CPUs."""
    try:
        import ray
    except ImportError:
        raise CmoeError("--ray needs Ray: pip install 'ray>=2.40' (scripts/setup installs it)") from None
    if ray.is_initialized():
        return ray
    kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        if address == "auto":
            try:
                ray.init(address="auto", **kw)
            except ConnectionError:
                ray.init(num_cpus=jobs, **kw)
        else:
            ray.init(address=address, **kw)
    except Exception as e:
        raise CmoeError(f"cannot reach the Ray cluster at {address} ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}): start one with 'ray start --head' or use --ray auto") from None
    return ray


def _ray(batches: list[list[dict]], address: str, jobs: int):
    ray = connect_ray(address, jobs)
    task = ray.remote(num_cpus=1, max_retries=0)(run_batch)
    cpus = max(1, int(ray.cluster_resources().get("CPU", jobs)))
    todo, pending = list(reversed(batches)), {}
    try:
        while todo or pending:
            while todo and len(pending) < 4 * cpus:
                b = todo.pop()
                pending[task.remote(b)] = b
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                b = pending.pop(ref)
                try:
                    yield from ray.get(ref)
                except Exception as e:
                    yield from _crashed(b, e)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def sweep(points: list[dict], out: Path, *, jobs: int = 2, ray: str | None = None, resume: bool = False,
          retry_errors: bool = False, progress: bool = True, on_row=None) -> SweepStats:
    """Run `points` (normalised, see cmoe.sweep.points) into the table `out`. With `resume`, points
    already in it are skipped (and, with `retry_errors`, those that failed run again). `on_row(row,
    stats)` is called for every new row. Ctrl-C writes the finished rows, then re-raises."""
    from tqdm import tqdm
    if not points:
        raise CmoeError("the sweep has no points: give at least one trace, profile, pool size, policy and batch")
    from cmoe.sim.priced import check_profile
    for pr in dict.fromkeys(p["profile"] for p in points):   # fail fast on a bad name or file, or on what
        check_profile(pr, dict.fromkeys(p["policy"] for p in points if p["profile"] == pr))   # it cannot price
    ids = [point_id(p) for p in points]
    table = SweepTable(Path(out), ids, resume, retry_errors)
    done = table.done()
    todo = list({i: p for i, p in zip(ids, points) if i not in done}.values())
    stats = SweepStats(len(set(ids)), len(set(ids)) - len(todo), 0, 0, Path(out))
    if todo and not (ray is None and jobs <= 1):
        _warm()
    rows = _ray(_batches(todo, jobs), ray, jobs) if ray else _local(_batches(todo, jobs), jobs)
    bar = tqdm(total=len(todo), desc="sweep", unit="pt", disable=None if progress else True)
    bar.set_postfix_str(f"{stats.skipped} done before" if stats.skipped else "", refresh=False)
    try:
        for row in rows:
            table.add(row)
            stats.computed += 1
            stats.failed += bool(row["error"])
            bar.update()
            if on_row is not None:
                on_row(row, stats)
    finally:
        bar.close()
        rows.close()
        table.flush()
    if not table.had and not table.ok():
        r = next(iter(table.rows.values()))
        raise CmoeError(f"none of the {len(table.rows)} grid points could run; the first ({r['trace']}, {r['profile']}, "
                        f"pool {r['pool_gb']:g} GB, {r['policy']}, batch {r['batch']}): {r['error']}")
    return stats


def _warm() -> None:
    """Compile the replay here first, so the workers load it from the disk cache instead of each
    compiling it at once."""
    if os.environ.get("CMOE_NO_WARM"):
        return
    from cmoe.sim.replay.warm import warm
    warm()
