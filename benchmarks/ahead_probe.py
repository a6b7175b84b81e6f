"""Issue 16, the probe behind `cmoe.policy.ahead`: how deep a prefetch to look, how many of the
pass's predictions must agree before an expert is fetched, and how many of each prediction's
experts to fetch, on the default study (`cmoe simulate --pool-gb 20`: synthetic Mixtral-8x7B
W4A16, h200 profile, batch 1, 1,024 decode passes), in the SimPy model. Each row is the shipped
class with its class attributes set (depth, agree, top); the shipped defaults are depth 4,
agree 2, top 1. At depth 1 the engines hand a policy no deeper predictions, so it never
prefetches: such a row is the class's eviction alone (agree and top print as "-").

    python benchmarks/ahead_probe.py            # ~30 s on two CPU cores
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cmoe.core.hw import H200  # noqa: E402
from cmoe.core.metrics import summary  # noqa: E402
from cmoe.policy import policies as P  # noqa: E402
from cmoe.sim.engine import Simulation  # noqa: E402
from cmoe.sim.run import SimConfig, _facts, layout_for, passes_for  # noqa: E402
from cmoe.trace.load import load_trace  # noqa: E402
from cmoe.trace.pass_arrays import Future, to_passes  # noqa: E402

GRID = [(P.Adaptive, {}), (P.AdaptiveAhead, {"depth": 1, "agree": 1}), (P.AdaptiveAhead, {"depth": 2, "agree": 1}),
        (P.AdaptiveAhead, {"depth": 4, "agree": 1}), (P.AdaptiveAhead, {"depth": 2, "agree": 2}),
        (P.AdaptiveAhead, {"depth": 3, "agree": 2}), (P.AdaptiveAhead, {"depth": 4, "agree": 2}),
        (P.AdaptiveAhead, {"depth": 4, "agree": 3}), (P.AdaptiveAhead, {"depth": 4, "agree": 2, "top": 2}),
        (P.Commit, {}), (P.CommitAhead, {"depth": 1, "agree": 1}), (P.CommitAhead, {"depth": 4, "agree": 1}),
        (P.CommitAhead, {"depth": 4, "agree": 2}), (P.CommitAhead, {"depth": 4, "agree": 2, "top": 2})]


def main() -> None:
    t = load_trace("synthetic:mixtral-8x7b")
    cfg = SimConfig(policy="ondemand", pool_gb=20, batch=1)
    layout, _ = layout_for(t, cfg)
    pop, costs, _ = _facts(t)
    pa = passes_for(t, cfg)
    passes = to_passes(pa)

    def run(cls, attrs):
        pol = type(cls.__name__, (cls,), attrs)(layout, t.spec.num_experts, pop, Future(pa))
        return summary(Simulation(pol, H200, costs, passes, False, keep_spans=False).simulate())

    best = run(P.Oracle, {})["tokens_per_s"]
    print(f"oracle: {best:.1f} tok/s")
    print("| policy | depth | agree | top | tok/s | x oracle | loads | routed experts skipped | late |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cls, attrs in GRID:
        s = run(cls, attrs)
        a = {"depth": getattr(cls, "depth", 1), "agree": getattr(cls, "agree", "-"), "top": getattr(cls, "top", "-"), **attrs}
        if a["depth"] == 1:                      # nothing to agree on or fetch: eviction only
            a["agree"] = a["top"] = "-"
        print(f"| {cls.name} | {a['depth']} | {a['agree']} | {a['top']} | {s['tokens_per_s']:.1f} | "
              f"{s['tokens_per_s'] / best:.2f} | {s['loads']} | {s['skipped']} | {s['late']} |")


if __name__ == "__main__":
    main()
