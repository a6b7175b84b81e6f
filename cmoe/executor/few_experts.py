"""Which expert-kernel configuration a launch of n experts runs (pure: no torch, no Triton).

The kernel's configuration is chosen by the batch's rows (`kernels_triton.moe.pick_config`): from
5 rows on, `CONFIGS` run w13 on one warp a CTA and w2 on two, right for a launch whose 8 experts
fill the machine. A loading policy's launch wave often names only 1-3 experts, and there the
configuration of M <= 4 (4 warps a CTA) is faster: on the H200 one expert at M = 8 took 38.5 us
on it against 58.3 on the M = 8 one, while a layer of 8 took 232.2 against 222.5 (thirteenth
session, `benchmarks/results/lean-h200-13/call3-kernel_variants.json`), and the thirty-ninth
session's validation saw one-expert waves at batch 8 take 64.9 us. So a launch whose table names
at most `FEW_EXPERTS[bucket]` experts runs bucket `FEW_BUCKET`'s configuration; the lean executor
captures a second graph per layer for it and picks one by the wave's size
(`benchmarks/wave_config_h200.py` measures where the switch pays).

The switch is on unless CMOE_FEW_EXPERTS turns it off (`ON`, from 2026-12-07). On an H100 (forty-
second session, `benchmarks/results/few-experts-h100-c0181d5/`, tree c0181d5) it was measured in
two calls, each arm right after its twin. At batch 8, all 12 loading runs (ondemand, lru-prefetch,
oracle; pools 20 and 26) spent 0.06-0.20 ms (0.7-2.2%) less GPU time a pass in their experts with
it, and tokens/s moved -0.3% to +1.3% (median +0.2%): those runs are link-bound (1.02-1.39x the
link limit). At batch 16 the one-expert twin bought nothing end to end (expert time -0.1% to
+0.4%, tokens/s -0.2% to +0.5%), though one wave alone ran 4% faster on it. So only bucket 8 has a
threshold. A twin costs its capture, +24 ms a bucket (median; the process's first, which compiles
the M <= 4 configuration, +250-355 ms). The twins' GPU test passed there too. On the H200 the
thirteenth session's one-expert wave at M = 8 favoured the M <= 4 configuration as strongly (38.5
against 58.3 us), while a full layer of 8 experts favoured the M = 8 one (222.5 against 232.2),
which a launch of at most 3 never is.

The simulator prices a launch by its expert count and rows, fitted over calibrate's own launches.
The switch brings the executor closer to that: in that session's validation, run with the switch
off, a one-expert wave at batch 8 took 64.5 us against 51.4 predicted, and 48.3 on the twin.
Calibrate and each run record the setting (`describe`); the profile's launch fit does not depend
on it, as `upper`'s launches, which it is made of, never switch. CMOE_FEW_EXPERTS=on (or unset)
takes `FEW_EXPERTS`' thresholds, CMOE_FEW_EXPERTS=n one threshold for every bucket that has one (1
is a threshold, not "on": a launch of one expert), and CMOE_FEW_EXPERTS=off or 0 turns it off.
Only graphed decode passes switch (the twins); eager launches keep their bucket's configuration.
"""

from __future__ import annotations

import os

from cmoe.core.errors import CmoeError

FEW_BUCKET = 4                       # the configuration a launch of few experts runs
# row bucket -> the most experts that run it: where the M <= 4 configuration was no slower at every
# count up to it, on an H100 (fortieth and forty-second sessions, `benchmarks/results/few-experts-h100-*`):
# at M = 8 one expert's wave 48.7 and 48.3 us against 66.5 and 65.1, three 113.2 and 113.0 against
# 125.5 and 125.3, four 145.4 and 145.5 against 141.3 and 141.4. M = 16 (one expert 63.9 and 63.2
# against 67.1 and 65.9) has none: its runs gained nothing end to end (above)
FEW_EXPERTS: dict[int, int] = {8: 3}
ON = True                            # the thresholds apply unless CMOE_FEW_EXPERTS turns them off
BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # `kernels_triton.moe.CONFIGS`' row buckets


def bucket(rows: int) -> int:
    """The row bucket whose configuration a launch of `rows` rows runs (the smallest >= rows)."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return BUCKETS[-1]


def setting(env: dict | None = None) -> int | None:
    """CMOE_FEW_EXPERTS read: None for the table's thresholds (`on`, or unset while `ON`), a number
    of experts for one threshold (0: off, as `off` is); anything else is refused, at any
    batch, with one line saying what to give."""
    given = (os.environ if env is None else env).get("CMOE_FEW_EXPERTS", "").strip()
    raw = given.lower()
    if raw in ("", "off"):
        return None if raw == "" and ON else 0
    if raw == "on":
        return None
    if raw.isdigit():
        return int(raw)
    raise CmoeError(f"CMOE_FEW_EXPERTS={given!r}: give on (the measured thresholds), off, or a whole number of "
                    "experts (the most a launch may name; 0 is off)")


def threshold(rows: int, env: dict | None = None) -> int:
    """The most experts a launch of `rows` rows may name and still run the few-expert
    configuration; 0 where every launch runs its bucket's own (the switch off, or no twin for the bucket)."""
    n = setting(env)
    b = bucket(rows)
    if b not in FEW_EXPERTS:
        return 0
    return FEW_EXPERTS[b] if n is None else n


def describe(env: dict | None = None) -> str:
    """What a run or a calibration records (`HardwareProfile.few_experts`, the run's metrics): "off",
    or each twinned bucket's threshold, "8:3" (older records: "8:3 16:1"); a validation keeps the
    profile's and the runs' side by side (`cmoe.analysis.validate`)."""
    if setting(env) == 0:
        return "off"
    return " ".join(f"{b}:{threshold(b, env)}" for b in sorted(FEW_EXPERTS))


def twin(experts: int, limit: int) -> bool:
    """Whether a launch naming `experts` experts runs the few-expert configuration, where `limit`
    (`threshold` at the captured rows) is the most that may: the Python step's choice, which the
    host program's `_graph` makes in machine code."""
    return 0 < experts <= limit
