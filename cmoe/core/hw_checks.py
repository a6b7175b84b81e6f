"""The checks `HardwareProfile` runs on every field where a profile is made: what each kind of
field allows, and the one-line error naming the field, its value and what it must be."""

from __future__ import annotations

import json
import math
import re

from cmoe.core.errors import CmoeError


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def whole(least: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= least, f"a whole number >= {least}")


POSITIVE = (lambda v: finite(v) and v > 0, "positive (a finite number > 0)")
NON_NEGATIVE = (lambda v: finite(v) and v >= 0, "a finite number >= 0 (a time or a fraction)")
FLAG = (lambda v: isinstance(v, bool), "true or false")
RATES = ("h2d_pageable_gbps", "hbm_gbps", "matmul_tflops", "cpu_expert_gbps")   # divided by: > 0
WAIT_TABLES = (    # (field, what a point holds, the y's rule; None: any y > 0) of the tables read after a wait
    ("host_wake_points", "[wait us, factor]: a wait >= 0, a factor > 0, waits ascending", None),
    ("cpu_wake_points", "[idle us, extra us]: an idle >= 0, extra us >= 0, idles ascending", NON_NEGATIVE[0]),
    ("host_pass_start_points", "[pass us, extra us]: a pass >= 0, extra us >= 0, passes ascending", NON_NEGATIVE[0]),
    ("host_boundary_points", "[wait us, extra us]: a wait >= 0, extra us >= 0, waits ascending", NON_NEGATIVE[0]))
# CMOE_FEW_EXPERTS' thresholds as `cmoe.executor.few_experts.describe` writes them ("": unrecorded)
FEW = (lambda v: isinstance(v, str) and re.fullmatch(r"|off|\d+:\d+( \d+:\d+)*", v) is not None,
       '"off", or bucket:threshold pairs such as "8:3" or "8:3 16:1", or "" (unrecorded)')
STRINGS = {"few_experts": FEW}        # string fields with a form of their own (any string else)
LEAST = {"gpu_mem_bytes": 1, "copy_engines": 1, "dense_rows": 0, "attn_split_block": 1}


def rule(name: str, type_: str):
    """(test, what is allowed) for a scalar field, from its annotation; None for the others."""
    if type_ == "float":
        return POSITIVE if name in RATES else NON_NEGATIVE
    if type_ == "int":
        return whole(LEAST.get(name, 0))
    if type_ == "str":
        return STRINGS.get(name, (lambda v: isinstance(v, str), "a string"))
    return FLAG if type_ == "bool" else None


def check_pairs(profile: str, field_name: str, pts, key_ok, allowed: str, ascending: bool, rate=None) -> None:
    """A curve or table of (key, rate) pairs: a non-empty tuple of pairs whose key passes `key_ok`
    and whose rate is positive (or passes `rate`; keys distinct; ascending where asked)."""
    rate = rate or POSITIVE[0]
    if not isinstance(pts, tuple) or not pts:
        raise bad(profile, field_name, pts, f"a non-empty list of {allowed}")
    for p in pts:
        if not (isinstance(p, tuple) and len(p) == 2 and key_ok(p[0]) and rate(p[1])):
            raise bad(profile, f"{field_name} point", p, allowed)
    keys = [k for k, _ in pts]
    if (ascending and keys != sorted(keys)) or len(set(keys)) < len(keys):
        raise bad(profile, field_name, pts, allowed)


def bad(profile: str, field_name: str, value, allowed: str) -> CmoeError:
    try:
        shown = json.dumps(value)                   # as the profile JSON spells it: "fast", NaN, [1, 2.0]
    except (TypeError, ValueError):
        shown = repr(value)
    return CmoeError(f"hardware profile '{profile}': {field_name} is {shown}, but it must be {allowed}; "
                     "fix the profile JSON or run cmoe calibrate again")
