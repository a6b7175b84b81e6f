"""Where a decode pass's time goes (`cmoe.analysis.breakdown`), on a hand-built timeline whose
every interval is counted below."""

from __future__ import annotations

import pytest

from cmoe.analysis.breakdown import PARTS, expert_traffic, pass_breakdown

S = "gpu"
SPANS = [
    # pass 0 (prefill): never counted
    (S, 0, 0, "compute", "expert", 2, -100.0, -90.0, 0),
    (S, 0, 0, "copy0", "load", 2, -120.0, -100.0, 10),
    # pass 1 (decode): window 0..75 us, from the host's first span to the last compute span
    (S, 1, -1, "host", "host_attention", -1, 0.0, 5.0, 0),
    (S, 1, 0, "compute", "attention", -1, 10.0, 20.0, 0),
    (S, 1, 0, "compute", "route", -1, 20.0, 22.0, 0),
    (S, 1, 0, "copy0", "load", 3, 15.0, 40.0, 10),
    (S, 1, 0, "compute", "expert", 3, 40.0, 50.0, 0),
    (S, 1, 0, "cpu", "cpu_expert", 5, 50.0, 60.0, 0),
    (S, 1, 0, "compute", "expert", 1, 65.0, 70.0, 0),
    (S, 1, 1, "compute", "attention", -1, 70.0, 75.0, 0),
]


def test_a_pass_splits_into_parts_that_add_up_to_its_window():
    got = pass_breakdown(SPANS, decode={1})
    # busy: experts 40-50, 65-70; the rest 10-22, 70-75. Idle: 0-10, 22-40, 50-65
    want = {"experts": 15.0, "attention, router, head": 17.0, "idle: copy in flight": 18.0,   # 22-40 under the load
            "idle: CPU experts": 10.0, "idle: host": 15.0}                                  # 50-60; 0-10 and 60-65
    assert list(got) == list(PARTS)
    assert got == pytest.approx({k: v / 1e3 for k, v in want.items()})
    assert sum(got.values()) == pytest.approx(75.0 / 1e3)


def test_with_its_latency_a_pass_also_holds_the_wait_before_its_first_span():
    # latency 90 us: the window opens at -15, where a copy of the last pass (-20..-5) still flies
    late = SPANS + [(S, 0, 7, "copy0", "load", 4, -20.0, -5.0, 10)]
    got = pass_breakdown(late, decode={1}, latency={1: 90.0})
    assert got["idle: copy in flight"] == pytest.approx((18.0 + 10.0) / 1e3)   # -15..-5 as well
    assert got["idle: host"] == pytest.approx((15.0 + 5.0) / 1e3)              # -5..0 as well
    assert sum(got.values()) == pytest.approx(90.0 / 1e3)


def test_overlapping_spans_are_counted_once_and_passes_are_averaged():
    two = SPANS + [(S, 2, 0, "compute", "expert", 1, 100.0, 110.0, 0),
                   (S, 2, 0, "compute", "expert", 2, 105.0, 112.0, 0),       # overlaps the first: 100-112
                   (S, 2, 0, "compute", "attention", -1, 108.0, 120.0, 0)]   # 112-120 is not an expert's
    got = pass_breakdown(two, decode={1, 2})
    assert got["experts"] == pytest.approx((15.0 + 12.0) / 2 / 1e3)
    assert got["attention, router, head"] == pytest.approx((17.0 + 8.0) / 2 / 1e3)
    assert got["idle: host"] == pytest.approx(15.0 / 2 / 1e3)


def test_expert_traffic_counts_runs_copies_and_cpu_runs_of_decode_passes():
    assert expert_traffic(SPANS, decode={1}) == {
        (0, 3): {"runs": 1, "loads": 1, "cpu": 0},
        (0, 5): {"runs": 1, "loads": 0, "cpu": 1},
        (0, 1): {"runs": 1, "loads": 0, "cpu": 0}}
    assert expert_traffic(SPANS, decode={0}) == {(0, 2): {"runs": 1, "loads": 1, "cpu": 0}}


def test_a_pass_with_no_compute_span_is_left_out():
    assert pass_breakdown([(S, 1, -1, "host", "host_attention", -1, 0.0, 5.0, 0)], decode={1}) == dict.fromkeys(PARTS, 0.0)
