"""`benchmarks/boundary_by_wait.py`: each decode pass's boundary read off a measured run's spans."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.boundary_by_wait import boundaries


def _pass(p: int, t: float, wait: float, head: float, start: float, loads: int) -> list[tuple]:
    spans = [("gpu", p, 0, "host", "host_attention", -1, t, t + start),
             ("gpu", p, 1, "host", "host_sync", -1, t + 500, t + 500 + wait),
             ("gpu", p, -1, "host", "host_head", -1, t + 600 + wait, t + 600 + wait + head)]
    return spans + [("gpu", p, 1, "copy0", "load", k, t + 10, t + 20, 1) for k in range(loads)]


def test_a_pass_boundary_pairs_its_head_with_the_next_passs_start():
    spans = (_pass(0, 0, 9, 9, 999, 9) + _pass(1, 1e4, 140.0, 30.0, 80.0, 2) + _pass(2, 2e4, 1500.0, 170.0, 95.0, 0)
             + _pass(3, 3e4, 2000.0, 160.0, 250.0, 20))
    run = SimpleNamespace(spans=spans, passes=[{"pass": p, "decode": p > 0} for p in range(4)])
    # pass 1 is the first decode pass (left out), pass 3 has no pass after it
    assert boundaries(run) == [(1500.0, 170.0, 250.0, 0)]
    run.passes.append({"pass": 4, "decode": True})
    run.spans += _pass(4, 4e4, 10.0, 10.0, 55.0, 1)
    assert boundaries(run) == [(1500.0, 170.0, 250.0, 0), (2000.0, 160.0, 55.0, 20)]
