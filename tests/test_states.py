"""cmoe.analysis.states: a run's host lane in two states, named by the validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cmoe.analysis.states import pass_host_us, slow_host, two_states
from cmoe.analysis.validate import format_validation, read_run, validate
from cmoe.core.timeline import write_parquet

META = {"policy": "ondemand", "model": "m", "trace_id": "t", "batch": 1, "experts_fit": 4, "tokens_per_s": 1.0,
        "tpot_ms_mean": 1.0}


def _host(passes: int, slow: set[int], noise: float = 0.0, seed: int = 0) -> list[tuple]:
    """A measured run's host lane: four MoE layers a pass, the first 40 us (the pass start), the rest
    2.5 us, or 5 us in the passes `slow`; with `noise`, each span times exp(N(0, noise))."""
    rng, out = np.random.default_rng(seed), []
    for p in range(passes):
        t = p * 1000.0
        for layer in range(4):
            d = 40.0 if layer == 0 else (5.0 if p in slow else 2.5) * float(np.exp(rng.normal(0, noise)))
            out.append(("gpu", p, layer, "host", "host_attention", -1, t, t + d, 0))
            t += 100.0
    return out


def test_two_states_marks_the_slower_group_where_it_is_apart():
    got, mask = two_states([1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0])
    assert got == {"share": 0.3, "factor": 2.0, "separation": 1.0}
    assert mask.tolist() == [False, False, True, False, False, True, False, False, False, True]
    got, mask = two_states([1.0, 1.1] * 5)                       # 1.1x apart: one state
    assert got["share"] == 0.0 and not mask.any() and got["factor"] == pytest.approx(1.1)
    wide = np.exp(np.random.default_rng(1).normal(0, 0.3, 200))  # one wide state: its halves 1.5x apart
    got, mask = two_states(wide)
    assert got["factor"] > 1.3 and got["separation"] < 0.7 and got["share"] == 0.0 and not mask.any()
    assert two_states([1.0] * 7) is None                         # too few to say
    assert two_states([1.0] * 9 + [0.0]) is None                 # a value that is no time
    assert two_states([1.0] * 5 + [2.0] * 4 + [float("nan")]) is None
    assert two_states([1.0] * 9 + [float("inf")]) is None
    got, mask = two_states([1.0] * 7 + [3.0])                   # one outlier of eight is no state
    assert got["share"] == 0.0 and not mask.any()
    got, _ = two_states([1.0] * 6 + [3.0] * 2)                  # two of eight are
    assert got["share"] == 0.25 and got["factor"] == pytest.approx(3.0)


def test_the_host_speed_of_a_pass_leaves_its_start_out():
    spans = _host(3, {1}) + [("gpu", 9, 0, "host", "host_attention", -1, 0, 3, 0)]   # pass 9: one span
    assert pass_host_us(spans, {0, 1, 2, 9}) == {0: 2.5, 1: 5.0, 2: 2.5}
    assert pass_host_us(spans, {0}) == {0: 2.5}
    # commit writes two spans at the first layer, a short one and the pass start: neither counts
    two = [("gpu", 0, 0, "host", "host_attention", -1, 0, 7, 0), ("gpu", 0, 0, "host", "host_attention", -1, 10, 210, 0),
           ("gpu", 0, 1, "host", "host_attention", -1, 300, 303, 0), ("gpu", 0, 2, "host", "host_attention", -1, 400, 403, 0)]
    assert pass_host_us(two, {0}) == {0: 3.0}
    # a pass whose spans past the first take no time says nothing of the host's speed
    assert pass_host_us([s[:6] + (s[6], s[6], 0) if s[2] > 0 else s for s in two], {0}) == {}


def test_slow_host_splits_the_passes_and_prices_the_fast_ones():
    """20 passes, 6 of them on a host twice as slow; the prediction is right for the fast passes
    (1,000 us) and 10% fast for the slow ones (measured 1,100): end to end it misses, over the fast
    passes it does not."""
    slow = {2, 3, 4, 11, 12, 13}
    pred = {p: {"tokens": 1, "us": 1000.0} for p in range(20)}
    meas = {p: {"tokens": 1, "us": 1100.0 if p in slow else 1000.0} for p in range(20)}
    got = slow_host(_host(20, slow, noise=0.02), set(range(20)), pred, meas)
    assert got["share"] == 0.3 and got["factor"] == pytest.approx(2.0, rel=0.05)
    assert got["fast_error"] == 0.0 and got["slow_passes"] == [2, 3, 4, 11, 12, 13]
    one = slow_host(_host(20, set(), noise=0.02), set(range(20)), pred, meas)       # one state: no split
    assert one["share"] == 0.0 and "fast_error" not in one
    assert slow_host(_host(7, set()), set(range(7)), pred, meas) is None            # too few passes
    assert slow_host([], set(range(20)), pred, meas) is None                       # no host lane


def _folder(path, spans, passes):
    path.mkdir()
    (path / "metrics.json").write_text(json.dumps([META]))
    write_parquet(spans, path / "timeline-ondemand.parquet")
    (path / "passes-ondemand.json").write_text(json.dumps(passes))
    return path


def test_validate_names_the_host_state_and_the_error_without_it(tmp_path):
    slow = {5, 6, 7, 8}
    comp = lambda p: [("x", p, layer, "compute", "attention", -1, p * 1000.0 + layer * 100, p * 1000.0 + layer * 100 + 90, 0)
                      for layer in range(4)]                                       # noqa: E731
    pred_passes = [{"pass": p, "decode": True, "tokens": 1, "us": 1000.0} for p in range(16)]
    meas_passes = [{"pass": p, "decode": True, "tokens": 1, "us": 1250.0 if p in slow else 1020.0} for p in range(16)]
    pred = _folder(tmp_path / "p", [s for p in range(16) for s in comp(p)], pred_passes)
    meas = _folder(tmp_path / "m", [s for p in range(16) for s in comp(p)] + _host(16, slow), meas_passes)
    v = validate(read_run(pred, "ondemand"), read_run(meas, "ondemand"))
    assert v["slow_host"] == {"share": 0.25, "factor": pytest.approx(2.0), "separation": pytest.approx(1.0), "slow_passes": [5, 6, 7, 8],
                              "fast_error": pytest.approx(1020 / 1000 - 1)}
    assert v["tokens_per_s"]["error"] == pytest.approx((16 * 1020 + 4 * 230) / 16000 - 1)
    assert ("the host lane ran 2.00x slower in 25% of the passes than in the rest, a state of the machine no "
            "profile prices; over the other passes end to end +2.0%") in format_validation(v)
    v["slow_host"] = {"share": 0.05, "factor": 2.0, "fast_error": 0.0}
    assert "host lane" not in format_validation(v)
    v["slow_host"] = None                                                           # a run without a host lane
    assert "host lane" not in format_validation(v)


def test_cmoe_run_says_how_many_runs_ran_in_two_states():
    from cmoe.analysis.states import states_note
    one = {"slow_host": {"share": 0.25, "factor": 1.5, "separation": 0.9, "fast_error": -0.021}}
    two = {"slow_host": {"share": 0.5, "factor": 2.0, "separation": 0.95, "fast_error": 0.013}}
    calm = {"slow_host": {"share": 0.0, "factor": 1.1, "separation": 0.6}}
    assert states_note([one, calm, {"slow_host": None}, two]) == (      # the run without a host lane: not counted
        "the host lane ran in two states in 2 of 3 runs (the slow one 1.50x to 2.00x, 25% to 50% of their passes); "
        "over their other passes alone the errors were -2.1% to +1.3%")
    assert states_note([one, calm]) == ("the host lane ran in two states in 1 of 2 runs (the slow one 1.50x, 25% of "
                                        "their passes); over their other passes alone the errors were -2.1%")
    assert states_note([calm, {}]) is None


def test_the_compare_report_marks_the_slow_passes_and_prices_the_fast_ones(tmp_path):
    """`cmoe report PREDICTED MEASURED`: the table's column of the error over the host's fast passes,
    and the per-pass chart with the slow ones open."""
    pytest.importorskip("plotly")
    from cmoe.report.build import compare_report
    from cmoe.report.charts import pass_ratio
    slow = {5, 6, 7, 8}
    comp = lambda p: [("x", p, layer, "compute", "attention", -1, p * 1000.0 + layer * 100, p * 1000.0 + layer * 100 + 90, 0)
                      for layer in range(4)]                                       # noqa: E731
    pred = _folder(tmp_path / "p", [s for p in range(16) for s in comp(p)],
                   [{"pass": p, "decode": True, "tokens": 1, "us": 1000.0} for p in range(16)])
    meas = _folder(tmp_path / "m", [s for p in range(16) for s in comp(p)] + _host(16, slow),
                   [{"pass": p, "decode": True, "tokens": 1, "us": 1250.0 if p in slow else 1020.0} for p in range(16)])
    _, body = compare_report(pred, meas, 10_000)
    assert "<th>error, the passes both ran</th><th>error, the host&#x27;s fast passes</th>" in body
    # over the 16 passes both ran: 17,240 us measured against 16,000 predicted, +7.75%
    assert "<td>+0.0%</td><td>+7.8%</td><td>+2.0% (25% slow)</td>" in body
    assert "Each decode pass, measured over predicted" in body
    fig = pass_ratio([("ondemand", [(0, 1.02, False), (5, 1.25, True)])])
    (trace,) = fig.data
    assert list(trace.x) == [0, 5] and list(trace.y) == [1.02, 1.25]
    assert list(trace.marker.symbol) == ["circle", "circle-open"] and list(trace.text) == ["", "slow host"]


def test_the_compare_report_says_which_policy_it_could_not_validate(tmp_path):
    """One policy without a measured passes file: its cells read n/a and a note says why; the other
    is still validated and charted, its host in one state ("-")."""
    pytest.importorskip("plotly")
    from cmoe.report.build import compare_report
    comp = [("x", p, layer, "compute", "attention", -1, p * 1000.0 + layer * 100, p * 1000.0 + layer * 100 + 90, 0)
            for p in range(10) for layer in range(4)]
    passes = [{"pass": p, "decode": True, "tokens": 1, "us": 1000.0} for p in range(10)]
    for side in ("p", "m"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "metrics.json").write_text(json.dumps([META, dict(META, policy="upper")]))
        for pol in ("ondemand", "upper"):
            write_parquet(comp + (_host(10, set()) if side == "m" else []), tmp_path / side / f"timeline-{pol}.parquet")
            if not (side == "m" and pol == "upper"):
                (tmp_path / side / f"passes-{pol}.json").write_text(json.dumps(passes))
    _, body = compare_report(tmp_path / "p", tmp_path / "m", 10_000)
    assert "<td>ondemand</td><td>1.0</td><td>1.0</td><td>+0.0%</td><td>+0.0%</td><td>-</td>" in body
    assert "<td>upper</td><td>1.0</td><td>1.0</td><td>+0.0%</td><td>n/a</td><td>n/a</td>" in body
    assert "no per-layer or per-pass comparison of upper: " in body and "Each decode pass" in body


def test_layer0_states_reads_a_layers_error_over_each_host_state():
    """`benchmarks/layer0_states.by_state`: layer 0 predicted at 100 us; measured 100 us in the 6
    fast passes and 150 in the 6 slow ones (the host lane at 5 us a layer there, two states): 0% and
    -33.3%; a state under `least` passes says nothing; a run in one state is read whole."""
    import importlib.util
    from pathlib import Path
    from cmoe.analysis.validate import Run
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "layer0_states.py"
    spec = importlib.util.spec_from_file_location("layer0_states", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    slow = {1, 3, 5, 7, 9, 11}

    def comp(p, l0):
        t = p * 1000.0
        return [("x", p, 0, "compute", "attention", -1, t, t + l0, 0),
                ("x", p, 1, "compute", "attention", -1, t + l0, t + l0 + 50, 0)]
    passes = [{"pass": p, "decode": True, "tokens": 1, "us": 500.0} for p in range(12)]
    pred = Run(Path("p"), META, [s for p in range(12) for s in comp(p, 100.0)], passes)
    meas = Run(Path("m"), META, [s for p in range(12) for s in comp(p, 150.0 if p in slow else 100.0)]
               + _host(12, slow), passes)
    fast, slow_err = mod.by_state(pred, meas, 0, 5)
    assert fast == 0.0 and slow_err == pytest.approx(100 / 150 - 1)
    assert mod.by_state(pred, meas, 0, 7) == (None, None)
    one = Run(Path("m"), META, meas.spans[:-48] + _host(12, set()), passes)           # one state: all its passes
    assert mod.by_state(pred, one, 0, 5) == (pytest.approx(100 / 125 - 1), None)        # 100 against 125
