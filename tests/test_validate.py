"""cmoe validate on hand-made timelines: alignment, error arithmetic, attribution, refusals."""

from __future__ import annotations

import json

import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.timeline import write_parquet
from cmoe.analysis.validate import format_validation, read_run, validate, validate_folders

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
    assert v["per_token"]["signed"] == pytest.approx(-60 / 440)
    assert v["tokens_per_s"]["predicted"] == pytest.approx(1e6 / 380)
    assert v["tokens_per_s"]["error"] == pytest.approx(440 / 380 - 1)
    c = v["components_us"]
    assert c["predicted"] == {"non-expert compute": 220, "expert compute": 110, "waits and gaps": 50, "pass": 380}
    assert c["measured"] == {"non-expert compute": 300, "expert compute": 110, "waits and gaps": 30, "pass": 440}
    assert v["error_from"] == "non-expert compute"
    text = format_validation(v)
    assert "error +15.8%" in text and "the error comes mostly from non-expert compute (-0.08 ms per pass)" in text


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


def test_repeats_of_different_configurations_are_refused(runs):
    from cmoe.analysis.validate import against_repeats
    one = validate_folders(runs[0], runs[1])
    with pytest.raises(CmoeError, match="the measured folders hold different policies"):
        against_repeats([one, one + one])
