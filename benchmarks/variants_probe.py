"""Issue 16, a probe: how far simple policy variants move the default study (`cmoe simulate
--pool-gb 20`: synthetic Mixtral-8x7B W4A16, h200 profile, batch 1, 1,024 decode passes) toward
`oracle`. The variants live here, not in cmoe.policy: they run in the SimPy model only, and their
quality (KL to exact routing) is not measured; this says which mechanisms are worth building.

    python benchmarks/variants_probe.py            # ~20 s on two CPU cores

Variants, each a subclass of a shipped policy:
- eviction: commit and ondemand with LFU (counts of use so far) or popularity (the trace's own
  expert frequencies, a static ranking) in place of LRU;
- skip: the shipped `adaptive` policy (a token's top-1 expert always, loaded if missing; a
  lower-ranked one only if already resident; batch 1, so the pass's ranking is the token's
  weight order); with popularity eviction; with a prefetch of the next layer's predicted top-1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.hw import H200  # noqa: E402
from cmoe.core.metrics import summary  # noqa: E402
from cmoe.policy import policies as P  # noqa: E402
from cmoe.sim.engine import Simulation  # noqa: E402
from cmoe.sim.run import SimConfig, _facts, layout_for, passes_for  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402
from cmoe.trace.pass_arrays import to_passes  # noqa: E402


def _lfu(self, m, protect):
    c = [v for v in self.pool.where[m] if v not in protect]
    return min(c, key=lambda v: self.freq[m][v]) if c else None


def _popular(self, m, protect):
    c = [v for v in self.pool.where[m] if v not in protect]
    return min(c, key=lambda v: self.popularity[m][v]) if c else None


class CommitLFU(P.Commit):
    name = "commit, LFU eviction"
    victim = _lfu

    def plan(self, m, needed, predicted_next):
        for e in needed:                       # Commit.plan counts nothing in decode
            self.freq[m][e] += 1
        return super().plan(m, needed, predicted_next)


class CommitPopular(P.Commit):
    name = "commit, popularity eviction"
    victim = _popular


class OnDemandLFU(P.OnDemand):
    name = "ondemand, LFU eviction"
    victim = _lfu


class SkipPopular(P.Adaptive):
    name = "skip, popularity eviction"
    victim = _popular


class SkipPrefetchPopular(SkipPopular):
    name = "skip, popularity eviction, prefetch next top-1"
    uses_prediction = True

    def plan(self, m, needed, predicted_next):
        p = super().plan(m, needed, predicted_next)
        if self.decode and predicted_next and m + 1 < len(self.layout.slots):
            p.loads += self.ensure(m + 1, list(predicted_next[:1]), "prefetch", protect=set(predicted_next[:1]))[0]
        return p


def main() -> None:
    t = load_trace("synthetic:mixtral-8x7b")
    cfg = SimConfig(policy="ondemand", pool_gb=20, batch=1)
    layout, _ = layout_for(t, cfg)
    pop, costs, _ = _facts(t)
    passes = to_passes(passes_for(t, cfg))
    future = [p.needed for p in passes]
    rows = []
    for cls in (P.OnDemand, P.Commit, P.Oracle, CommitLFU, CommitPopular, OnDemandLFU, P.Adaptive, SkipPopular,
                SkipPrefetchPopular):
        t0 = time.perf_counter()
        pol = cls(layout, t.spec.num_experts, pop, future)
        s = summary(Simulation(pol, H200, costs, passes, False, keep_spans=False).simulate())
        rows.append((cls.name, s["tokens_per_s"], s["loads"], s["skipped"], s["late"], time.perf_counter() - t0))
    best = dict((r[0], r[1]) for r in rows)["oracle"]
    print("| variant | tok/s | x oracle | loads | routed experts skipped | late |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, tps, loads, skipped, late, _ in rows:
        print(f"| {name} | {tps:.1f} | {tps / best:.2f} | {loads} | {skipped} | {late} |")


if __name__ == "__main__":
    main()
