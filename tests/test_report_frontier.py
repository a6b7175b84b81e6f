"""The frontier (`cmoe report RUN --quality QUALITY.json`): tokens/s against KL to exact routing, a
point per policy, `oracle` and `upper` as dashed lines. Exact points from a small simulated run and
a hand-written quality file; what is not measured is listed, never drawn at 0; bad inputs are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cmoe.analysis.runfolder import read_metrics
from cmoe.core.errors import CmoeError
from cmoe.policy.policies import POLICIES, trait
from cmoe.report.build import build_report
from cmoe.report.frontier import MEASURED_WITH, frontier_data, frontier_figure, read_quality

ROWS = [{"variant": "exact", "kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 1.0, "perplexity": 2.5, "skipped": 0},
        {"variant": "commit", "kl_mean": 0.0398, "kl_p99": 0.8, "top1_agreement": 0.93, "perplexity": 2.6, "skipped": 290},
        {"variant": "commit-no-owa", "kl_mean": 0.25, "kl_p99": 2.0, "top1_agreement": 0.8, "perplexity": 3.1, "skipped": 290},
        {"variant": "adaptive", "kl_mean": 0.0077, "kl_p99": 0.1, "top1_agreement": 0.979, "perplexity": 2.49, "skipped": 220},
        {"variant": "adaptive-ahead", "kl_mean": 0.0081, "kl_p99": 0.1, "top1_agreement": 0.975, "perplexity": 2.49, "skipped": 230},
        {"variant": "commit-ahead", "kl_mean": 0.0412, "kl_p99": 0.8, "top1_agreement": 0.925, "perplexity": 2.6, "skipped": 300}]
SKIPPING = ("commit", "adaptive", "adaptive-ahead", "commit-ahead")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Every policy on a short synthetic Mixtral trace (a second or two)."""
    from cmoe.core.hw import load_profile
    from cmoe.core.quant import recipe
    from cmoe.core.spec import preset
    from cmoe.sim.api import write_outputs
    from cmoe.sim.run import SimConfig, simulate
    from cmoe.trace.synthetic import SyntheticParams, generate
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=24))
    prof = load_profile("h200")
    out = tmp_path_factory.mktemp("frontier") / "sim"
    write_outputs(out, t, prof, [simulate(t, prof, SimConfig(policy=p, pool_gb=20)) for p in POLICIES])
    return out


def _quality(path: Path, rows=ROWS) -> Path:
    path.write_text(json.dumps({"model": "tiny-moe", "tokens": 64, "window": 256, "rows": rows}))
    return path


def _tps(folder: Path) -> dict[str, float]:
    return {m["policy"]: m["tokens_per_s"] for m in json.loads((folder / "metrics.json").read_text())}


def test_the_points_are_the_runs_tokens_per_s_and_the_quality_files_kl(run, tmp_path):
    f = frontier_data(read_metrics(run), read_quality(_quality(tmp_path / "q.json")))
    tps = _tps(run)
    assert sorted(p["policy"] for p in f.points) == sorted(POLICIES)
    assert [p["tokens_per_s"] for p in f.points] == sorted(tps.values(), reverse=True)       # fastest first
    by = {p["policy"]: p for p in f.points}
    for pol in POLICIES:
        assert by[pol]["tokens_per_s"] == tps[pol]
        assert by[pol]["x_oracle"] == tps[pol] / tps["oracle"]
    assert (by["commit"]["kl"], by["commit"]["top1"]) == (0.0398, 0.93)                      # OWA on, not commit-no-owa
    assert (by["adaptive"]["kl"], by["adaptive"]["top1"]) == (0.0077, 0.979)
    assert (by["adaptive-ahead"]["kl"], by["commit-ahead"]["top1"]) == (0.0081, 0.925)
    exact = [p for p in POLICIES if p not in SKIPPING]
    assert all((by[p]["kl"], by[p]["top1"]) == (0.0, 1.0) for p in exact)
    assert f.unmeasured == [] and len(f.drawn) == len(POLICIES)
    assert f.lines == {"oracle": tps["oracle"], "upper": tps["upper"]}
    fig = frontier_figure(f)
    assert len(fig.data) == len(POLICIES) and [t.text[0] for t in fig.data] == [p["policy"] for p in f.points]
    assert sorted(s.y0 for s in fig.layout.shapes) == sorted([tps["oracle"], tps["upper"]])
    assert all(s.y0 == s.y1 and s.line.dash == "dash" for s in fig.layout.shapes)


def test_an_unmeasured_skipping_policy_is_listed_not_drawn(run, tmp_path):
    q = _quality(tmp_path / "q.json", [r for r in ROWS if r["variant"] != "adaptive"])
    f = frontier_data(read_metrics(run), read_quality(q))
    assert f.unmeasured == ["adaptive"]
    assert "adaptive" not in [p["policy"] for p in f.drawn] and len(f.drawn) == len(POLICIES) - 1
    assert next(p for p in f.points if p["policy"] == "adaptive")["kl"] is None
    assert "adaptive" not in [t.name for t in frontier_figure(f).data]
    text = build_report([run], tmp_path / "r.html", quality=q).read_text()
    assert "<td>adaptive</td>" in text and "<td>not measured</td><td>not measured</td>" in text
    assert "not drawn (not measured, never put at KL 0): adaptive" in text
    assert "run cmoe quality --variants adaptive --out FILE" in text


def test_lines_and_x_oracle_only_where_the_run_has_them():
    metrics = [{"policy": "commit", "tokens_per_s": 30.0}, {"policy": "ondemand", "tokens_per_s": 20.0},
               {"policy": "upper", "tokens_per_s": 80.0}, {"policy": "newfangled", "tokens_per_s": 50.0}]
    f = frontier_data(metrics, {"rows": ROWS})
    assert f.lines == {"upper": 80.0}
    assert [p["x_oracle"] for p in f.points] == [None] * 4
    assert f.unmeasured == ["newfangled"]             # a policy this version does not know: not put at 0
    assert [(p["policy"], p["kl"]) for p in f.drawn] == [("upper", 0.0), ("commit", 0.0398), ("ondemand", 0.0)]


def test_the_report_has_the_frontier_section(run, tmp_path):
    page = build_report([run], tmp_path / "r.html", quality=_quality(tmp_path / "q.json"))
    text = page.read_text()
    assert "<h2>Frontier: tokens/s against KL to exact routing</h2>" in text
    assert "<th>x oracle</th><th>KL nats</th><th>top-1 agree</th>" in text
    assert "<td>commit</td>" in text and "<td>0.0398</td><td>0.930</td>" in text
    assert "dashed: oracle at" in text and "not drawn" not in text
    assert text.index("Frontier") < text.index("<h2>Timeline")
    assert "Frontier" not in build_report([run], tmp_path / "plain.html").read_text()


def test_bad_quality_input_is_refused_in_one_line(run, tmp_path):
    fix = "pass --quality the JSON file that cmoe quality --out FILE writes"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CmoeError, match="is not readable JSON") as e:
        build_report([run], tmp_path / "r.html", quality=tmp_path / "bad.json")
    assert fix in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "norows.json").write_text(json.dumps({"model": "x", "variants": []}))
    with pytest.raises(CmoeError, match="has no 'rows' list of variants, so it is not what cmoe quality writes"):
        build_report([run], tmp_path / "r.html", quality=tmp_path / "norows.json")
    with pytest.raises(CmoeError, match="a row lacks a variant, a finite kl_mean"):
        read_quality(_quality(tmp_path / "q1.json", [{"variant": "commit", "top1_agreement": 0.9}]))
    with pytest.raises(CmoeError, match="two rows for variant commit"):
        read_quality(_quality(tmp_path / "q2.json", [ROWS[1], ROWS[1]]))
    with pytest.raises(CmoeError, match="does not exist: " + fix):
        build_report([run], tmp_path / "r.html", quality=tmp_path / "nope.json")
    q = _quality(tmp_path / "q.json")
    for inputs in ([run, run], [run / "timeline-upper.parquet"]):
        with pytest.raises(CmoeError, match="--quality goes with one run folder"):
            build_report(inputs, tmp_path / "r.html", quality=q)


def test_cli_report_with_quality(run, tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    q = _quality(tmp_path / "q.json")
    r = CliRunner().invoke(app, ["report", str(run), "--quality", str(q), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert "Frontier" in (tmp_path / "r.html").read_text()
    (tmp_path / "bad.json").write_text("[]")
    r = CliRunner().invoke(app, ["report", str(run), "--quality", str(tmp_path / "bad.json"), "--out", str(tmp_path / "s.html")])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and "not what cmoe quality writes" in r.output


def test_the_variant_of_a_skipping_policy_is_its_own_name_with_owa_on():
    """frontier.py reads no torch, so it names the variants itself; here they are held to VARIANTS."""
    from cmoe.quality.run import VARIANTS
    skipping = {p for p in POLICIES if trait(p, "skips")}
    assert skipping == set(SKIPPING) == set(MEASURED_WITH)
    pools = {"all": "every expert resident", "half": "half of each layer's experts in the pool"}
    for pol in skipping:
        assert VARIANTS[pol][:2] == (pol, True)
        assert MEASURED_WITH[pol] == pools[VARIANTS[pol][2]]
