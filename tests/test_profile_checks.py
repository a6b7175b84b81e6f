"""A hardware profile is checked where it is made: every impossible cost or wrong type is one line
naming the field, its value and what is allowed, from the constructor and from `--profile FILE`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, HardwareProfile

GOOD = H200.to_dict()

# field changed -> (its bad value, what the message must hold)
CASES = {
    "fractional copy_engines": ({"copy_engines": 1.5}, "copy_engines is 1.5, but it must be a whole number >= 1"),
    "zero copy_engines": ({"copy_engines": 0}, "copy_engines is 0, but it must be a whole number >= 1"),
    "string rate": ({"hbm_gbps": "4300"}, 'hbm_gbps is "4300", but it must be positive'),
    "string time": ({"launch_us": "5"}, 'launch_us is "5", but it must be a finite number >= 0'),
    "zero expert_gbps": ({"expert_gbps": [["int4", 0.0], ["bf16", 3390.0]]},
                         'expert_gbps point is ["int4", 0.0], but it must be [class, GB/s]'),
    "negative expert_gbps": ({"expert_gbps": [["int4", -1730.0]]}, 'expert_gbps point is ["int4", -1730.0]'),
    "unknown expert class": ({"expert_gbps": [["fp8", 1730.0]]}, 'expert_gbps point is ["fp8", 1730.0]'),
    "negative layer_fixed_us": ({"layer_fixed_us": -255.0}, "layer_fixed_us is -255.0, but it must be a finite number >= 0"),
    "negative launch_us": ({"launch_us": -5.0}, "launch_us is -5.0"),
    "negative roundtrip_us": ({"roundtrip_us": -60.0}, "roundtrip_us is -60.0"),
    "NaN rate": ({"matmul_tflops": float("nan")}, "matmul_tflops is NaN, but it must be positive"),
    "NaN time": ({"host_sync_us": float("nan")}, "host_sync_us is NaN"),
    "infinite rate": ({"cpu_expert_gbps": float("inf")}, "cpu_expert_gbps is Infinity"),
    "NaN in a curve": ({"h2d_pinned": [[65536, float("nan")], [1048576, 34.6]]}, "h2d_pinned point is [65536, NaN]"),
    "fractional bytes": ({"d2h_pinned": [[65536.5, 5.3]]}, "d2h_pinned point is [65536.5, 5.3]"),
    "descending sizes": ({"h2d_pinned": [[1048576, 34.6], [65536, 5.3]]}, "h2d_pinned is [[1048576, 34.6], [65536, 5.3]]"),
    "empty curve": ({"d2h_pinned": []}, "d2h_pinned is [], but it must be a non-empty list"),
    "flag as number": ({"copy_fifo": 1}, "copy_fifo is 1, but it must be true or false"),
    "negative dense_rows": ({"dense_rows": -1}, "dense_rows is -1, but it must be a whole number >= 0"),
    "null": ({"gpu_mem_bytes": None}, "gpu_mem_bytes is null"),
    "negative attention slowdown": ({"copy_attention_slowdown": -0.1},
                                    "copy_attention_slowdown is -0.1, but it must be null or a finite number >= 0"),
    "string attention slowdown": ({"copy_attention_slowdown": "0.1"}, 'copy_attention_slowdown is "0.1"'),
    "negative launch extra": ({"copy_launch_us": -1.0},
                              "copy_launch_us is -1.0, but it must be null or a finite number >= 0"),
    "missing field": ({"hbm_gbps": ...}, "missing the fields ['hbm_gbps']"),
}


def _bad_profile(tmp_path, change: dict):
    d = {k: v for k, v in {**GOOD, **change}.items() if v is not ...}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))              # NaN and Infinity as Python's json writes and reads them
    return path


@pytest.mark.parametrize("case", CASES)
def test_bad_profile_is_one_line_naming_the_field(tmp_path, case):
    change, fragment = CASES[case]
    r = CliRunner().invoke(app, ["simulate", "--profile", str(_bad_profile(tmp_path, change)),
                                 "--trace", "embedded", "--slots", "4", "--policy", "upper"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)      # no crash underneath
    assert fragment in r.output
    assert next(iter(change)) in r.output                                   # the field, by name


def test_constructor_checks_too():
    with pytest.raises(CmoeError) as e:
        replace(H200, layer_fixed_us=-1.0)
    assert str(e.value) == ("hardware profile 'h200': layer_fixed_us is -1.0, but it must be a finite number >= 0 "
                            "(a time or a fraction); fix the profile JSON or run cmoe calibrate again")
    with pytest.raises(CmoeError) as e:
        replace(H200, copy_engines=2.5)
    assert str(e.value) == ("hardware profile 'h200': copy_engines is 2.5, but it must be a whole number >= 1; "
                            "fix the profile JSON or run cmoe calibrate again")


def test_good_profiles_still_load_and_whole_floats_are_whole_numbers():
    assert HardwareProfile.from_dict(GOOD) == H200
    p = HardwareProfile.from_dict({**GOOD, "gpu_mem_bytes": 141e9, "copy_engines": 2.0})
    assert p.gpu_mem_bytes == 141 * 10**9 and type(p.copy_engines) is int and p.copy_engines == 2


def test_the_attention_slowdown_is_optional_and_round_trips():
    """Profiles written before it had no `copy_attention_slowdown`: they read as null, the attention
    side then slowed by `copy_compute_slowdown` as before; a measured one survives JSON."""
    old = {k: v for k, v in GOOD.items() if k != "copy_attention_slowdown"}
    p = HardwareProfile.from_dict(old)
    assert p.copy_attention_slowdown is None and p.attention_slow == 1.0 + H200.copy_compute_slowdown
    q = replace(H200, copy_attention_slowdown=0.125)
    assert HardwareProfile.from_dict(json.loads(json.dumps(q.to_dict()))) == q and q.attention_slow == 1.125
