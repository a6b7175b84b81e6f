"""What a run did and the figures both engines report, defined once (floor 1: plain data).

The simulator (`cmoe.sim.engine`) and the executor (`cmoe.executor.engine`) each fill one
`RunRecord` as they go, through the same calls, and `summary` turns it into the metrics row both
print. So a figure means the same thing predicted and measured:

- An executed GPU expert is a **hit** when no copy of its weights was still in flight when its
  kernel was due (the moment the compute stream, and the host issuing it, reached the kernel),
  and its own layer's plan did not load it. It is **demand** when its own layer's plan loaded it
  (a miss however fast the copy was), and **late** when an earlier plan prefetched it but the
  copy had not landed when the kernel was due (the kernel stalled). Fallbacks (experts computed
  on the CPU) are misses too; `hit_rate = hits / (GPU experts + fallbacks)`.
- **stall**: time kernels waited for their weights (demand and late experts), plus time the GPU
  waited for CPU experts' results.
- Every count in a metrics row is over **decode passes** only, like tokens/s and TPOT (the
  row's `scope`); prefill is reported apart (`prefill_ms`, `prefill_loads`).
- A load is counted in the pass that issued it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

HIT, LATE, DEMAND = "hits", "late", "demand"           # PassCounts fields
SCOPE = "decode"


@dataclass
class PassCounts:
    """One pass's tally."""
    hits: int = 0
    late: int = 0
    demand: int = 0
    fallbacks: int = 0
    skipped: int = 0
    loads: int = 0
    bytes_moved: int = 0
    stall_us: float = 0.0

    @property
    def gpu_experts(self) -> int:
        return self.hits + self.late + self.demand

    @property
    def ran(self) -> int:
        return self.gpu_experts + self.fallbacks


def classify(own_load: bool, landed_us: float | None, due_us: float) -> tuple[str, float]:
    """One executed GPU expert: how its weights came, and how long its kernel waited for them.
    `landed_us` is when the copy still pending for it landed (None: none was pending)."""
    wait = max(0.0, landed_us - due_us) if landed_us is not None else 0.0
    if own_load:
        return DEMAND, wait
    return (LATE if wait > 0 else HIT), wait


@dataclass
class RunRecord:
    """Timeline and tally of one run under one policy, filled by either engine."""
    spans: list = field(default_factory=list)
    pass_us: list = field(default_factory=list)          # (pass, decode, tokens, latency us)
    occupancy: list = field(default_factory=list)        # per pass: experts resident at its end
    per_pass: dict = field(default_factory=dict)         # pass index -> PassCounts

    def at(self, p: int) -> PassCounts:
        c = self.per_pass.get(p)
        if c is None:
            c = self.per_pass[p] = PassCounts()
        return c

    def ran(self, p: int, kind: str, wait_us: float) -> None:
        c = self.at(p)
        setattr(c, kind, getattr(c, kind) + 1)
        c.stall_us += wait_us

    def loaded(self, p: int, nbytes: int) -> None:
        c = self.at(p)
        c.loads += 1
        c.bytes_moved += nbytes

    def total(self, name: str, decode: bool | None = None) -> float:
        """A count summed over all passes, or over decode (True) or prefill (False) passes."""
        if decode is None:
            return sum(getattr(c, name) for c in self.per_pass.values())
        keep = {p for p, d, _, _ in self.pass_us if d == decode}
        return sum(getattr(c, name) for p, c in self.per_pass.items() if p in keep)

    # the whole run's totals (every pass), for tests and calibration
    loads = property(lambda self: self.total("loads"))
    bytes_moved = property(lambda self: self.total("bytes_moved"))
    hits = property(lambda self: self.total("hits"))
    gpu_experts = property(lambda self: self.total("gpu_experts"))
    fallbacks = property(lambda self: self.total("fallbacks"))
    skipped = property(lambda self: self.total("skipped"))
    stall_us = property(lambda self: self.total("stall_us"))

    def pass_rows(self) -> list[dict]:
        """What `passes-POLICY.json` holds: per pass latency, occupancy and hits among experts run."""
        rows = []
        for (p, d, n, us), occ in zip(self.pass_us, self.occupancy):
            c = self.per_pass.get(p, PassCounts())
            rows.append({"pass": p, "decode": bool(d), "tokens": n, "us": us, "occupancy": occ,
                         "hits": c.hits, "experts": c.ran})
        return rows


def summary(rec: RunRecord) -> dict:
    """The metrics every engine reports, over decode passes (the scope), prefill apart."""
    from cmoe.core.util import percentile

    dec = [(n, us) for _, d, n, us in rec.pass_us if d]
    pre_us = sum(us for _, d, _, us in rec.pass_us if not d)
    dec_tokens, dec_us = sum(n for n, _ in dec), sum(us for _, us in dec)
    lat = [us for _, us in dec]
    keep = {p for p, d, _, _ in rec.pass_us if d}
    counts = [c for p, c in rec.per_pass.items() if p in keep]        # rec.total(name, True), filtered once

    def total(name: str):
        return sum(getattr(c, name) for c in counts)
    ran = total("ran")
    return {
        "scope": SCOPE, "decode_passes": len(dec),
        "tokens_per_s": dec_tokens / dec_us * 1e6 if dec_us else float("nan"),
        "tpot_ms_mean": statistics.fmean(lat) / 1e3 if lat else float("nan"),
        "tpot_ms_p50": percentile(lat, 0.5) / 1e3, "tpot_ms_p99": percentile(lat, 0.99) / 1e3,
        "prefill_ms": pre_us / 1e3, "prefill_loads": int(rec.total("loads", False)), "decode_tokens": dec_tokens,
        "stall_ms": total("stall_us") / 1e3, "bytes_moved": int(total("bytes_moved")),
        "loads": int(total("loads")),
        "hit_rate": total("hits") / ran if ran else 1.0,
        "hits": int(total("hits")), "late": int(total("late")),
        "demand": int(total("demand")),
        "fallbacks": int(total("fallbacks")), "skipped": int(total("skipped")),
        "mean_occupancy": statistics.fmean(occ) if (occ := [o for (_, d, _, _), o in zip(rec.pass_us, rec.occupancy) if d])
        else 0,
    }
