"""cmoe validate on hand-made timelines: alignment, error arithmetic, attribution, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.timeline import write_parquet
from cmoe.analysis.validate import format_validation, read_run, slow_cpu, validate, validate_folders

BASE = {"policy": "commit", "model": "m", "trace_id": "abc", "batch": 1, "experts_fit": 4, "tokens_per_s": 1.0,
        "tpot_ms_mean": 1.0}
# pass 0 is a prefill (not compared); pass 1 a decode pass. Predicted: 380 us, a 50 us stall in layer 1.
PRED = [("sim", 0, 0, "compute", "attention", -1, 0, 900, 0),
        ("sim", 1, 0, "compute", "attention", -1, 1000, 1100, 0), ("sim", 1, 0, "compute", "expert", 1, 1100, 1150, 9),
        ("sim", 1, 1, "copy0", "load", 2, 1100, 1300, 9), ("sim", 1, 1, "compute", "attention", -1, 1150, 1250, 0),
        ("sim", 1, 1, "compute", "expert", 2, 1300, 1360, 9), ("sim", 1, -1, "compute", "head", -1, 1360, 1380, 0)]
MEAS = [("gpu", 1, 0, "compute", "attention", -1, 0, 120, 0), ("gpu", 1, 0, "compute", "route", -1, 120, 130, 0),
        ("gpu", 1, 0, "compute", "expert", 1, 130, 170, 9), ("gpu", 1, 1, "copy0", "load", 2, 130, 330, 9),
        ("gpu", 1, 1, "compute", "attention", -1, 170, 290, 0), ("gpu", 1, 1, "compute", "route", -1, 290, 300, 0),
        ("gpu", 1, 1, "compute", "expert", 2, 330, 400, 9), ("gpu", 1, -1, "compute", "head", -1, 400, 440, 0),
        # the host's own lane: not compared with the compute stream's spans
        ("gpu", 1, 0, "host", "host_attention", -1, 0, 118, 0), ("gpu", 1, 0, "host", "host_expert", 1, 130, 160, 0)]


def _folder(path, spans, passes, **over):
    path.mkdir()
    (path / "metrics.json").write_text(json.dumps([dict(BASE, **over)]))
    write_parquet(spans, path / "timeline-commit.parquet")
    (path / "passes-commit.json").write_text(json.dumps(passes))
    return path


@pytest.fixture
def runs(tmp_path):
    pred = _folder(tmp_path / "p", PRED, [{"pass": 0, "decode": False, "tokens": 8, "us": 900},
                                          {"pass": 1, "decode": True, "tokens": 1, "us": 380}])
    meas = _folder(tmp_path / "m", MEAS, [{"pass": 1, "decode": True, "tokens": 1, "us": 440}])
    return pred, meas


def test_errors_by_hand(runs):
    v = validate(read_run(runs[0], "commit"), read_run(runs[1], "commit"))
    assert v["decode_passes"] == 1
    ne = v["op_kinds"]["non-expert"]           # (100 vs 130) twice, head 20 vs 40
    assert ne["n"] == 3
    assert ne["mape"] == pytest.approx((30 / 130 * 2 + 0.5) / 3)
    assert ne["signed"] == pytest.approx(-(30 / 130 * 2 + 0.5) / 3)
    ex = v["op_kinds"]["expert"]               # 50 vs 40, 60 vs 70
    assert ex["mape"] == pytest.approx((0.25 + 10 / 70) / 2) and ex["signed"] == pytest.approx((0.25 - 10 / 70) / 2)
    assert v["op_kinds"]["load"]["mape"] == 0.0 and v["op_kinds"]["load"]["n"] == 1
    # per layer, stalls included: layer 0 150 vs 170 us, layer 1 210 vs 230 us
    assert v["per_layer"][0]["signed"] == pytest.approx(-20 / 170)
    assert v["per_layer"][1]["signed"] == pytest.approx(-20 / 230)
    assert v["per_layer"][0]["mean_error"] == pytest.approx(-20 / 170)
    assert v["per_layer_mean_error_max"] == pytest.approx(-20 / 170)          # the worst layer, sign kept
    assert v["per_layer_worst"] == 0
    assert v["per_layer_mean_error_max_rest"] == pytest.approx(-20 / 230)     # past the first layer
    assert v["per_token"]["signed"] == pytest.approx(-60 / 440)
    assert v["tokens_per_s"]["predicted"] == pytest.approx(1e6 / 380)
    assert v["tokens_per_s"]["error"] == pytest.approx(440 / 380 - 1)
    c = v["components_us"]
    assert c["predicted"] == {"non-expert compute": 220, "expert compute": 110, "waits and gaps": 50, "pass": 380}
    assert c["measured"] == {"non-expert compute": 300, "expert compute": 110, "waits and gaps": 30, "pass": 440}
    assert v["error_from"] == "non-expert compute"
    text = format_validation(v)
    assert "error +15.8%" in text and "the error comes mostly from non-expert compute (-0.08 ms per pass)" in text
    assert "mean time, worst layer -11.8% (layer 0)" in text


@pytest.mark.parametrize("over, message", [
    ({"trace_id": "xyz"}, "the runs differ in trace: predicted abc, measured xyz"),
    ({"trace_id": None}, "used live routing: execute with --trace"),
    ({"experts_fit": 5}, "the runs differ in pool layout (expert slots): predicted 4, measured 5"),
    ({"batch": 8}, "the runs differ in batch: predicted 1, measured 8"),
    ({"model": "other"}, "the runs differ in model: predicted m, measured other"),
])
def test_mismatched_runs_are_refused(tmp_path, over, message):
    pred = _folder(tmp_path / "p", PRED, [{"pass": 1, "decode": True, "tokens": 1, "us": 380}])
    meas = _folder(tmp_path / "m", MEAS, [{"pass": 1, "decode": True, "tokens": 1, "us": 440}], **over)
    with pytest.raises(CmoeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(read_run(pred, "commit"), read_run(meas, "commit"))


def test_missing_policy_and_folders(runs, tmp_path):
    with pytest.raises(CmoeError, match="has no run of policy upper"):
        validate_folders(runs[0], runs[1], ["upper"])
    with pytest.raises(CmoeError, match="has no metrics.json"):
        validate_folders(runs[0], tmp_path / "nowhere")


def test_simulator_against_cpu_executor_end_to_end(tmp_path, checkpoints, tiny_trace):
    """The real pair: a simulation and a CPU execution of the same tiny trace, policy and layout,
    through the command line; every op kind aligns one to one."""
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    run = CliRunner().invoke
    r = run(app, ["simulate", "--trace", str(tiny_trace), "--policy", "ondemand", "--pool-gb", "0.2686",
                  "--out", str(tmp_path / "sim")])
    assert r.exit_code == 0, r.output
    r = run(app, ["execute", "--model", str(checkpoints["mixtral"]), "--trace", str(tiny_trace), "--device", "cpu",
                  "--policy-json", str(tmp_path / "sim" / "policy-ondemand.json"), "--tokens", "5",
                  "--out", str(tmp_path / "ex")])
    assert r.exit_code == 0, r.output
    r = run(app, ["validate", str(tmp_path / "sim"), str(tmp_path / "ex")])
    assert r.exit_code == 0, r.output
    v = json.loads((tmp_path / "ex" / "validation.json").read_text())[0]
    assert v["decode_passes"] == 5
    for k, e in v["op_kinds"].items():                                # same decisions, same spans,
        assert e["only_predicted"] == 0, k                              # except the LM head, which the
        assert e["only_measured"] == (5 if k == "non-expert" else 0), k  # simulator does not model yet
    assert (tmp_path / "ex" / "compare.html").is_file() and "report:" in r.output


def test_repeated_measurements_give_the_error_against_their_mean_and_their_spread(runs, tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    from cmoe.analysis.validate import against_repeats
    again = _folder(tmp_path / "m2", MEAS, [{"pass": 1, "decode": True, "tokens": 1, "us": 400}])
    rows = against_repeats([validate_folders(runs[0], runs[1]), validate_folders(runs[0], again)])
    mean = (1e6 / 440 + 1e6 / 400) / 2
    assert rows[0]["policy"] == "commit" and rows[0]["measured"] == pytest.approx([1e6 / 440, 1e6 / 400])
    assert rows[0]["error"] == pytest.approx(1e6 / 380 / mean - 1)
    assert rows[0]["spread"] == pytest.approx((1e6 / 400 - 1e6 / 440) / mean)
    r = CliRunner().invoke(app, ["validate", str(runs[0]), str(runs[1]), str(again), "--out", str(tmp_path / "v.json")])
    assert r.exit_code == 0, r.output
    assert "against the mean of 2 measured runs" in r.output
    doc = json.loads((tmp_path / "v.json").read_text())
    assert len(doc["runs"]) == 2 and doc["against_mean"][0]["error"] == pytest.approx(rows[0]["error"])


def test_each_layer_is_held_against_its_runs_mean_and_spread(runs, tmp_path):
    """`layer_repeats`: a second run whose layer 0 took 70 us less (its attention; everything after
    it earlier by as much). Layer 0: 150 us predicted against 170 and 100 measured, +11.1% against
    their mean, the runs 51.9% apart, the prediction between them: within. Layer 1: 210 against 230
    twice, -8.7% and below both: outside 8%, inside 9%. A third run of layer 0 at 300 us puts the
    prediction below all three runs, 170 x 0.92 = 156.4 > 150: outside, however far apart they are."""
    from cmoe.analysis.validate import against_repeats, format_repeats, layer_repeats

    def shifted(us, name, passed):
        spans = [s[:6] + ((s[6], s[7] + us) if s[4] == "attention" and s[2] == 0 and s[3] == "compute"
                          else (s[6] + us * (s[6] >= 120), s[7] + us * (s[6] >= 120))) + s[8:] for s in MEAS]
        return _folder(tmp_path / name, spans, [{"pass": 1, "decode": True, "tokens": 1, "us": passed}])
    fast, slow = shifted(-70, "m2", 370), shifted(130, "m3", 570)
    vs = [validate_folders(runs[0], f)[0] for f in (runs[1], fast, slow)]
    assert [v["per_layer"][0]["meas_mean_us"] for v in vs] == [170, 100, 300]
    assert all(v["per_layer"][1]["meas_mean_us"] == 230 for v in vs)
    lr = layer_repeats(vs[:2])
    assert lr["layers"][0]["error"] == pytest.approx(150 / 135 - 1) and lr["layers"][0]["spread"] == pytest.approx(70 / 135)
    assert lr["layers"][1]["error"] == pytest.approx(210 / 230 - 1) and lr["layers"][1]["spread"] == 0
    assert lr["worst"] == 0 and lr["within"] is False
    assert layer_repeats(vs[:2], tol=0.09)["within"] is True
    assert layer_repeats([vs[0], vs[2]], tol=0.09)["within"] is False       # below both: 156.4 > 150
    assert layer_repeats(vs, tol=0.09)["within"] is True                     # 100 <= 150 <= 300
    rows = against_repeats([[vs[0]], [vs[1]]])
    assert rows[0]["per_layer_repeats"] == lr
    assert "layer 0 +11.1%, runs 51.9% apart" in format_repeats(rows)


def test_repeats_of_different_configurations_are_refused(runs):
    from cmoe.analysis.validate import against_repeats
    one = validate_folders(runs[0], runs[1])
    with pytest.raises(CmoeError, match="the measured folders hold different policies"):
        against_repeats([one, one + one])


def test_host_speed_is_the_mean_attention_issue_after_the_first_layer():
    """The run's host speed: its mean `host_attention` span over the decode passes asked for, the
    first layer's (which carries the pass's start) left out; None without a host lane."""
    from cmoe.analysis.validate import host_layer_us
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 1, 0, "host", "host_attention", -1, 0.0, 300.0),      # the pass's start: left out
             Span("gpu", 1, 1, "host", "host_attention", -1, 300.0, 310.0),
             Span("gpu", 1, 2, "host", "host_attention", -1, 400.0, 414.0),
             Span("gpu", 2, 1, "host", "host_attention", -1, 900.0, 906.0),
             Span("gpu", 0, 1, "host", "host_attention", -1, 0.0, 99.0),      # prefill: not asked for
             Span("gpu", 1, 1, "host", "host_route", -1, 310.0, 350.0),       # another step of the host
             Span("gpu", 1, 1, "compute", "attention", -1, 300.0, 360.0),
             Span("gpu", 1, 3, "host", "host_predict", -1, 402.0, 407.0)]     # an eager early router: out
    assert host_layer_us(spans, {1, 2}) == pytest.approx((10.0 + 9.0 + 6.0) / 3)
    assert host_layer_us([s for s in spans if s.op != "host_attention"], {1, 2}) is None
    # MoE layers at decoder layers 1, 3 and 5 (a dense layer before each): a span covers two layers
    dense = [Span("gpu", 1, d, "host", "host_attention", -1, 100.0 * d, 100.0 * d + x)
             for d, x in ((1, 90.0), (3, 20.0), (5, 28.0))]
    assert host_layer_us(dense, {1}) == pytest.approx((20.0 + 28.0) / 4)


def test_a_host_k_times_slower_scales_the_hosts_costs_and_nothing_else():
    from dataclasses import fields, replace
    from cmoe.core.hw import H200, HOST_FIELDS, HOST_POINTS
    p = replace(H200, host_layer_us=10.0, host_sync_us=20.0, pass_gap_us=100.0, commit_start_us=50.0,
                host_route_points=((1, 30.0), (8, 40.0)), hbm_gbps=4000.0)
    q = p.host_scaled(1.5)
    assert (q.host_layer_us, q.host_sync_us, q.pass_gap_us, q.commit_start_us) == (15.0, 30.0, 150.0, 75.0)
    assert q.host_route_points == ((1, 45.0), (8, 60.0)) and q.host_route(4) == pytest.approx(1.5 * p.host_route(4))
    host = set(HOST_FIELDS) | set(HOST_POINTS)
    for f in fields(p):
        if f.name not in host:
            assert getattr(q, f.name) == getattr(p, f.name), f.name
    # the GPU's and the link's own costs, named here so that none can drift into HOST_FIELDS
    assert not host & {"pass_start_us", "head_us", "readback_gpu_us", "predict_gpu_us", "commit_gpu_us",
                       "commit_gpu_copy_us", "owa_gpu_us", "wave_count_us", "layer_fixed_us", "roundtrip_us",
                       "h2d_pinned", "expert_rows_us", "attn_us_per_cache_key"}
    assert all(isinstance(getattr(p, f), float) for f in HOST_FIELDS)


def test_a_link_k_times_as_fast_scales_the_h2d_curve_and_nothing_else():
    from dataclasses import fields
    from cmoe.core.hw import H200
    q = H200.link_scaled(0.95)
    assert q.h2d_pinned == tuple((b, g * 0.95) for b, g in H200.h2d_pinned)
    assert q.h2d_us(93_585_408) == pytest.approx(H200.h2d_us(93_585_408) / 0.95)
    for f in fields(H200):
        if f.name != "h2d_pinned":
            assert getattr(q, f.name) == getattr(H200, f.name), f.name


def test_cpu_experts_k_times_as_slow_scale_their_time_and_nothing_else():
    from dataclasses import fields, replace
    from cmoe.core.hw import H200
    from cmoe.analysis.validate import cpu_ratio
    p = replace(H200, cpu_expert_us_per_token=300.0, cpu_wake_points=((25.0, 0.0), (600.0, 400.0)))
    q = p.cpu_scaled(1.25)
    for t in (1, 2, 8):
        assert q.cpu_expert_us(93_585_408, t) == pytest.approx(p.cpu_expert_us(93_585_408, t) * 1.25)
    assert q.cpu_wake_points == ((25.0, 0.0), (600.0, 500.0))
    for f in fields(H200):
        if f.name not in ("cpu_expert_gbps", "cpu_expert_us_per_token", "cpu_wake_points"):
            assert getattr(q, f.name) == getattr(p, f.name), f.name
    assert cpu_ratio({"op_kinds": {"cpu_expert": {"n": 4, "pred_mean_us": 1000.0, "meas_mean_us": 1250.0}}}) == 1.25
    assert cpu_ratio({"op_kinds": {"cpu_expert": {"n": 0}}}) is None and cpu_ratio({"op_kinds": {}}) is None


def test_link_rate_is_the_loads_bytes_over_their_time_in_the_passes_compared():
    from cmoe.analysis.validate import link_gbps
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 1, 0, "copy0", "load", 3, 100.0, 1100.0, 50_000_000),      # 50 GB/s
             Span("gpu", 2, 4, "copy0", "load", 1, 2000.0, 2500.0, 30_000_000),     # 60 GB/s
             Span("gpu", 0, 0, "copy0", "load", 2, 0.0, 10.0, 10_000_000),          # prefill: not compared
             Span("gpu", 1, 0, "compute", "expert", 3, 1100.0, 1140.0, 50_000_000)]
    assert link_gbps(spans, {1, 2}) == pytest.approx(80_000_000 / 1500.0 / 1e3)
    assert link_gbps(spans, {3}) is None



def test_slow_loads_are_the_share_under_eighty_percent_of_the_predicted_rate():
    from cmoe.analysis.validate import slow_loads
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 1, 0, "copy0", "load", 3, 100.0, 1100.0, 50_000_000),      # 50 GB/s
             Span("gpu", 1, 1, "copy0", "load", 4, 1100.0, 2100.0, 39_000_000),     # 39 GB/s: under 40
             Span("gpu", 2, 4, "copy0", "load", 1, 2000.0, 2500.0, 20_500_000),     # 41 GB/s
             Span("gpu", 2, 5, "copy0", "load", 5, 3000.0, 4000.0, 30_000_000),     # 30 GB/s
             Span("gpu", 0, 0, "copy0", "load", 2, 0.0, 10.0, 1_000_000),           # prefill: not compared
             Span("gpu", 1, 0, "compute", "expert", 3, 1100.0, 1140.0, 1_000)]
    assert slow_loads(spans, {1, 2}, 50.0) == 0.5
    assert slow_loads(spans, {1, 2}, 40.0) == 0.25
    assert slow_loads(spans, {3}, 50.0) is None and slow_loads(spans, {1}, None) is None

def test_link_speed_is_each_loading_runs_measured_rate_over_its_predicted():
    from cmoe.analysis.validate import link_ratio
    from cmoe.pipeline import link_speed
    runs = [[{"policy": "upper", "link_gbps": {"predicted": None, "measured": None}},
             {"policy": "ondemand", "link_gbps": {"predicted": 50.0, "measured": 52.5}}],
            [{"policy": "oracle", "link_gbps": {"predicted": 50.0, "measured": 47.5}}, {"policy": "old"}]]
    assert link_speed(runs) == [1.05, 0.95]
    assert link_ratio(runs[1][1]) is None


def test_cpu_speed_is_each_cpu_expert_runs_measured_time_over_its_predicted():
    from cmoe.pipeline import cpu_speed
    runs = [[{"policy": "upper", "op_kinds": {"expert": {"n": 4}}},
             {"policy": "static", "op_kinds": {"cpu_expert": {"n": 9, "meas_mean_us": 1200.0, "pred_mean_us": 2000.0}}}],
            [{"policy": "lfu-fallback", "op_kinds": {"cpu_expert": {"n": 3, "meas_mean_us": 2300.0,
                                                                     "pred_mean_us": 2000.0}}},
             {"policy": "static", "op_kinds": {"cpu_expert": {"n": 0}}}, {"policy": "old"}]]
    assert cpu_speed(runs) == [0.6, 1.15]


def test_host_speed_reads_the_policies_whose_host_step_calibrate_times():
    """`upper` (no host step on the lean engine) and the committing policies (they plan behind their
    experts) are left out of the host-speed ratio; the rest are each run's time over the profile's."""
    from dataclasses import replace
    from cmoe.core.hw import H200
    from cmoe.pipeline import host_speed
    prof = replace(H200, host_layer_points=((1, 10.0), (8, 20.0)))
    runs = [[{"policy": "upper", "host_layer_us": 4.0}, {"policy": "ondemand", "host_layer_us": 15.0},
             {"policy": "commit", "host_layer_us": 40.0}, {"policy": "commit-ahead", "host_layer_us": 40.0},
             {"policy": "oracle", "host_layer_us": None}],
            [{"policy": "ondemand", "host_layer_us": 5.0}, {"policy": "lru-prefetch", "host_layer_us": 12.0}]]
    assert host_speed(runs, prof, 1) == [1.5, 0.5, 1.2]
    assert host_speed(runs, prof, 8) == [0.75, 0.25, 0.6]
    assert host_speed(runs, replace(H200, host_layer_points=(), host_layer_us=0.0), 1) == []


def test_calibrations_agree_counts_rows_within_two_percent_and_lists_the_rest():
    from cmoe.analysis.validate import calibrations_agree
    rows = [{"pool_gb": 16.0, "batch": 1, "policy": "upper", "predicted_tok_s": 100.0, "other_profile_tok_s": 101.9},
            {"pool_gb": 26.0, "batch": 1, "policy": "oracle", "predicted_tok_s": 200.0, "other_profile_tok_s": 184.0},
            {"pool_gb": 26.0, "batch": 2, "policy": "ondemand", "predicted_tok_s": 50.0, "other_profile_tok_s": 51.5},
            {"pool_gb": 20.0, "batch": 4, "policy": "commit", "predicted_tok_s": 40.0, "other_profile_tok_s": 39.2},
            {"pool_gb": 20.0, "batch": 8, "policy": "commit", "predicted_tok_s": 40.0}]       # no second prediction
    n, beyond = calibrations_agree(rows)
    assert n == 2
    assert [(p, b, pol) for p, b, pol, _ in beyond] == [(26.0, 1, "oracle"), (26.0, 2, "ondemand")]
    assert [round(d, 6) for *_, d in beyond] == [-0.08, 0.03]
    assert calibrations_agree(rows, tol=0.1) == (4, [])


def test_cpu_experts_off_their_calibration_get_a_line(runs):
    """`format_validation` names CPU experts that ran over 5% off their predicted time (a run's CPU
    speed moves between runs), and says nothing where they ran as predicted or where none ran."""
    v = validate(read_run(runs[0], "commit"), read_run(runs[1], "commit"))
    assert "CPU experts" not in format_validation(v)                     # none ran
    v["op_kinds"]["cpu_expert"] = {"n": 4, "pred_mean_us": 1000.0, "meas_mean_us": 1340.0, "mape": 0.34,
                                   "signed": 0.34, "only_predicted": 0, "only_measured": 0}
    assert "CPU experts ran 1.34x their calibrated time" in format_validation(v)
    v["op_kinds"]["cpu_expert"]["meas_mean_us"] = 1040.0
    assert "CPU experts ran" not in format_validation(v)


def test_a_run_whose_cpu_ran_in_two_states_says_so(tmp_path):
    """`slow_cpu` splits the CPU experts' measured-over-predicted times in two groups (tokens and
    idle cancel in the ratio) and names the slower group's share where the groups are 1.3x apart;
    `validate` reads it off the runs' `cpu_expert` spans, and `format_validation` names it even
    where the mean is within 5% of the calibration."""
    pred = {(s, 0, e): 1000.0 * (1 + e) for s in range(2) for e in range(5)}           # 10 experts, unequal
    meas = {k: v * (1.7 if k[0] == 0 and k[2] < 4 else 1.0) for k, v in pred.items()}  # 4 of them 1.7x slow
    assert slow_cpu(pred, meas) == {"share": 0.4, "factor": pytest.approx(1.7), "separation": pytest.approx(1.0)}
    rng = np.random.default_rng(0)
    many = {(s, 0, e): 1000.0 for s in range(40) for e in range(5)}
    one = {k: v * float(np.exp(rng.normal(0, 0.1))) for k, v in many.items()}          # one state, its noise
    assert slow_cpu(many, one)["share"] == 0.0
    two = {k: v * (1.6 if k[0] < 10 else 1.0) * float(np.exp(rng.normal(0, 0.05))) for k, v in many.items()}
    two[(0, 0, 0)] *= 30.0                                                              # an outlier makes no group
    assert slow_cpu(many, two)["share"] == 0.25 and slow_cpu(many, two)["factor"] == pytest.approx(1.6, rel=0.05)
    # mostly slow (85%), with a 3% tail that woke after long idle: the tail makes no group of its own
    most = {k: v * (1.3 if k[0] < 34 else 0.95) * (2.0 if k[0] == 0 and k[2] < 3 else 1.0)
            * float(np.exp(rng.normal(0, 0.03))) for k, v in many.items()}
    got = slow_cpu(many, most)
    assert got["share"] == 0.85 and got["factor"] == pytest.approx(1.3 / 0.95, rel=0.03)
    assert slow_cpu(pred, {k: v * 1.7 for k, v in pred.items()}) == {"share": 0.0, "factor": 1.0, "separation": 0.0}  # slow throughout
    wide = {k: v * float(np.exp(rng.normal(0, 0.3))) for k, v in many.items()}        # one wide state: its halves
    got = slow_cpu(many, wide)                                                         # 1.5x apart, no split
    assert got["factor"] > 1.3 and got["separation"] < 0.8 and got["share"] == 0.0
    assert slow_cpu(dict(list(pred.items())[:7]), meas) is None                        # too few to say
    assert slow_cpu({k: 0.0 for k in pred}, meas) is None                              # nothing predicted
    # the same through validate(): CPU expert spans in pass 1 of both runs
    cpu = [(1, 0, e, 100 + 10 * e) for e in range(10)]
    spans_p = PRED + [("sim", s, l, "cpu", "cpu_expert", e, t, t + 1000 * (1 + e % 5), 0) for s, l, e, t in cpu]
    spans_m = MEAS + [("gpu", s, l, "cpu", "cpu_expert", e, t, t + 1000 * (1 + e % 5) * (1.7 if e < 4 else 1.0), 0)
                      for s, l, e, t in cpu]
    passes_p = [{"pass": 0, "decode": False, "tokens": 8, "us": 900}, {"pass": 1, "decode": True, "tokens": 1, "us": 380}]
    v = validate(read_run(_folder(tmp_path / "p", spans_p, passes_p), "commit"),
                 read_run(_folder(tmp_path / "m", spans_m, [{"pass": 1, "decode": True, "tokens": 1, "us": 440}]), "commit"))
    assert v["slow_cpu"] == {"share": 0.4, "factor": pytest.approx(1.7), "separation": pytest.approx(1.0)}
    v["op_kinds"]["cpu_expert"] = {"n": 10, "pred_mean_us": 1000.0, "meas_mean_us": 1030.0, "mape": 0.03,
                                   "signed": 0.03, "only_predicted": 0, "only_measured": 0}
    assert ("CPU experts ran 1.03x their calibrated time; 40% of them ran 1.70x slower than the rest"
            in format_validation(v))
    v["slow_cpu"] = {"share": 0.05, "factor": 1.5}
    assert "CPU experts ran" not in format_validation(v)


def test_a_profile_measured_under_another_openmp_wait_policy_gets_a_line(runs):
    """`omp_note`: the runs' CPU experts under other OpenMP settings than the profile's were measured
    under (spinning threads ran them 1.45-1.91x faster on the lent H100s) get a line, and so does a
    binding one side has and the other lacks (bound processes ran faster in some calls); so
    do runs that spun against a profile that does not say. Nothing where they agree, where the
    profile does not say and the runs kept the default. Where no CPU expert ran, a line only where
    one side's team spun and the other's did not (the host's steps moved with it)."""
    from cmoe.analysis.validate import omp_note
    v = validate(read_run(runs[0], "commit"), read_run(runs[1], "commit"))
    assert v["omp_wait"] == {"profile": None, "runs": None}                  # folders from before it
    v["op_kinds"]["cpu_expert"] = {"n": 4, "pred_mean_us": 1000.0, "meas_mean_us": 1000.0, "mape": 0.0,
                                   "signed": 0.0, "only_predicted": 0, "only_measured": 0}
    tail = (", the runs' ran under ACTIVE: threads that spin or sleep between them moved them 1.45-1.91x on "
            "the lent H100s; calibrate under them")
    bound = "ACTIVE bind=close places=cores"
    tail_bound = (", the runs' ran under ACTIVE: threads bound to cores or not ran them at other speeds in some "
                  "calls on the lent H100s; calibrate under them")
    for prof, runs_, want in (("default", "ACTIVE", "  the profile's CPU experts were measured under "
                                                    "OpenMP default" + tail),
                              (None, "ACTIVE", "  the profile's CPU experts were measured under OpenMP settings "
                                               "it does not record" + tail),
                              (bound, "ACTIVE", f"  the profile's CPU experts were measured under OpenMP {bound}"
                                                + tail_bound),
                              ("PASSIVE bind=close", "ACTIVE", "  the profile's CPU experts were measured under "
                                                               "OpenMP PASSIVE bind=close" + tail),
                              ("ACTIVE", "ACTIVE", None), (bound, bound, None), (None, "default", None),
                              ("ACTIVE", None, None)):
        v["omp_wait"] = {"profile": prof, "runs": runs_}
        assert omp_note(v) == want
        said = [ln for ln in format_validation(v).splitlines() if "CPU experts were measured under" in ln]
        assert said == ([want] if want else [])
    v["op_kinds"]["cpu_expert"]["n"] = 0          # GPU-only runs: a line only where one side's team spun
    host = ("  the profile's host steps were measured under OpenMP {}, the runs' under {}: a team spinning on "
            "every core slowed GPU-only runs 0.7-1.3% on a lent H100; calibrate with {}")
    for prof, runs_, want in (("default", "ACTIVE", host.format("default", "ACTIVE", "OMP_WAIT_POLICY=ACTIVE set")),
                              (bound, "PASSIVE", host.format(bound, "PASSIVE", "--policy naming the runs' "
                                                                                "policies, or let cmoe run calibrate")),
                              ("ACTIVE", bound, None), ("default", "PASSIVE bind=close", None),
                              (" ", "ACTIVE", host.format(" ", "ACTIVE", "OMP_WAIT_POLICY=ACTIVE set")),
                              (None, "ACTIVE", None), ("ACTIVE", None, None)):
        v["omp_wait"] = {"profile": prof, "runs": runs_}
        assert omp_note(v) == want
        said = [ln for ln in format_validation(v).splitlines() if "host steps were measured under" in ln]
        assert said == ([want] if want else [])


def test_the_profiles_wait_policy_reaches_the_simulators_metrics():
    """A calibration's `device.omp_wait_policy` becomes the profile's, and `simulate` writes it into
    the predicted metrics beside the runs' own (`omp_wait_policy`), None where unrecorded; a profile
    JSON with another type there is refused in one line."""
    from dataclasses import replace
    from cmoe.core.hw import H200, HardwareProfile
    from cmoe.sim.run import SimConfig, simulate
    from cmoe.core.spec import preset
    from cmoe.core.quant import recipe
    from cmoe.trace.synthetic import SyntheticParams, generate
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=4))
    for prof, want in ((H200, None), (replace(H200, omp_wait_policy="ACTIVE"), "ACTIVE")):
        assert simulate(t, prof, SimConfig(policy="static", pool_gb=20, batch=1)).metrics["omp_wait_policy"] == want
    d = json.loads(json.dumps(H200.to_dict())) | {"omp_wait_policy": 3}
    with pytest.raises(CmoeError, match=r"^hardware profile 'h200': omp_wait_policy is 3, but it must be a string;"):
        HardwareProfile.from_dict(d)
