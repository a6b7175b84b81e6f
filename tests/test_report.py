"""Reports in a real browser: each generated page is opened in headless Chromium (Debian's
`chromium`, which .ci/run installs), must raise no JavaScript error, and must show, from the page
itself, charts with exactly the traces the data calls for. Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.hw import load_profile
from cmoe.core.quant import recipe
from cmoe.report.build import build_report
from cmoe.sim.api import write_outputs
from cmoe.sim.run import SimConfig, simulate
from cmoe.core.spec import preset
from cmoe.core.timeline import read_parquet
from cmoe.trace.synthetic import SyntheticParams, generate

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
needs_browser = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                   reason="headless Chromium is not installed (.ci/run installs it)")
_PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const __ce = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); __ce(...a); };
window.addEventListener('load', () => setTimeout(() => {
  const graphs = [...document.querySelectorAll('.plotly-graph-div')].map(d => ({
    traces: d.data.length, rendered: !!d._fullLayout, names: d.data.map(t => t.name || ''),
    types: d.data.map(t => t.type || 'scatter'),
    webgl: d.querySelectorAll('canvas').length, svg: d.querySelectorAll('svg.main-svg').length}));
  const p = document.createElement('pre'); p.id = 'probe';
  p.textContent = JSON.stringify({errors: window.__errors, graphs: graphs,
                                  offline: !document.querySelector('script[src]')});
  document.body.appendChild(p);
}, 300));
</script>"""
_FLAGS = ["--headless", "--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
          "--virtual-time-budget=20000"]


def open_in_browser(page: Path, name: str) -> dict:
    """Load the page in headless Chromium with a probe script; return what the page reports."""
    assert CHROMIUM, "chromium is not installed: .ci/run installs Debian's chromium"
    probe = page.with_name(page.stem + "-probe.html")
    probe.write_text(page.read_text().replace("<head>", "<head>" + _PROBE, 1))
    dom = subprocess.run([CHROMIUM, *_FLAGS, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, "the page never finished loading"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    subprocess.run([CHROMIUM, *_FLAGS, "--window-size=1400,1800", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def _sim_folder(tmp_path: Path, policies=("upper", "commit"), trace=None) -> Path:
    t = trace or generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=24))
    prof = load_profile("h200")
    results = [simulate(t, prof, SimConfig(policy=p, pool_gb=20)) for p in policies]
    out = tmp_path / "sim"
    write_outputs(out, t, prof, results)
    return out


def _expected_timeline_traces(folder: Path, policies) -> int:
    return sum(len({s[4] for s in read_parquet(folder / f"timeline-{p}.parquet")}) for p in policies)


@needs_browser
def test_simulation_report_renders_in_chromium(tmp_path):
    from cmoe.analysis.breakdown import PARTS
    folder = _sim_folder(tmp_path, ("upper", "ondemand", "commit"))
    page = build_report([folder])
    assert page == folder / "report.html"
    text = page.read_text()
    assert "<script src" not in text and "Plotly" in text                    # plotly.js inline: offline
    got = open_in_browser(page, "report-simulation")
    assert got["errors"] == []
    assert got["offline"]
    bars, breakdown, misses, timeline = got["graphs"]
    assert bars["types"] == ["bar"] and bars["svg"] > 0                      # one bar per policy, upper a line
    assert breakdown["names"] == list(PARTS) and set(breakdown["types"]) == {"bar"}
    assert misses["names"] == ["ondemand", "commit"] and set(misses["types"]) == {"heatmap"}   # upper never misses
    assert timeline["traces"] == _expected_timeline_traces(folder, ("upper", "ondemand", "commit"))
    assert timeline["webgl"] > 0 and timeline["rendered"]                   # WebGL segments, not SVG bars
    assert "Pool occupancy" not in text and "time (ms)" in text


def test_summary_charts_hold_the_runs_own_figures(tmp_path):
    """The breakdown bars and the miss heatmap carry exactly what cmoe.analysis computes of the run."""
    import plotly.io as pio

    from cmoe.analysis.breakdown import PARTS, expert_traffic, pass_breakdown
    from cmoe.analysis.runfolder import read_passes, read_timeline
    from cmoe.report.build import RUN_METRICS, _read_run, _summary_blocks
    from cmoe.report.page import Figures
    folder = _sim_folder(tmp_path, ("upper", "ondemand"))
    metrics, spans, passes = _read_run(folder, RUN_METRICS)
    figs = []

    class Keep(Figures):
        def div(self, fig):
            figs.append(fig)
            return ""
    _summary_blocks(metrics, spans, passes, Keep())
    bars, breakdown, misses = (pio.from_json(f.to_json()) for f in figs)
    assert list(bars.data[0].y) == ["upper", "ondemand"][::-1] if metrics[0]["tokens_per_s"] > metrics[1]["tokens_per_s"] \
        else list(bars.data[0].y) == ["upper", "ondemand"]
    tl = read_timeline(folder, "ondemand")
    rows = read_passes(folder, "ondemand", True)
    dec = {p["pass"] for p in rows if p["decode"]}
    want = pass_breakdown(tl, dec, {p["pass"]: p["us"] for p in rows})
    assert [tr.x[1] for tr in breakdown.data] == [want[p] for p in PARTS]          # row 1: ondemand
    tpot = next(x for x in metrics if x["policy"] == "ondemand")["tpot_ms_mean"]
    assert sum(want.values()) == pytest.approx(tpot)                                # the parts add up to TPOT
    traffic = expert_traffic(tl, dec)
    layers = sorted({m for m, _ in traffic})
    m, e = max(traffic, key=lambda k: traffic[k]["loads"])
    assert misses.data[0].z[layers.index(m)][e] == traffic[(m, e)]["loads"] / len(dec)
    assert sum(traffic[k]["loads"] for k in traffic) == next(x for x in metrics if x["policy"] == "ondemand")["loads"]


@needs_browser
def test_a_trace_bundle_gets_a_statistics_page(tmp_path):
    from cmoe.trace import bundle
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=2, prompt_len=8, decode_len=16))
    path = bundle.write(t, tmp_path / "tr")
    page = build_report([path])
    assert page == tmp_path / "tr-stats.html" and sorted(p.name for p in path.iterdir()) == sorted(
        p.name for p in bundle.write(t, tmp_path / "again").iterdir())             # nothing written into the bundle
    got = open_in_browser(page, "report-stats")
    assert got["errors"] == []
    load, lines = got["graphs"]
    assert load["types"] == ["heatmap"]
    assert lines["names"] == ["entropy of the load / log E", "consecutive tokens keep the first expert",
                              "consecutive tokens share an expert", "commit prediction holds the true expert"]
    assert "rep_1st" in page.read_text()                                      # the cmoe stats table


@needs_browser
def test_sweep_report_draws_a_line_per_policy_with_upper_as_ceiling(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"trace": "t", "profile": "h200", "batch": b, "policy": p, "pool_gb": g,
             "tokens_per_s": (80.0 if p == "upper" else 10.0 + g + b), "error": ""}
            for b in (1, 8) for p in ("upper", "commit", "ondemand") for g in (12.0, 16.0, 20.0)]
    rows.append({"trace": "t", "profile": "h200", "batch": 1, "policy": "static", "pool_gb": 4.0,
                 "tokens_per_s": None, "error": "pool too small"})
    path = tmp_path / "sweep.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    page = build_report([path])
    assert page == tmp_path / "sweep.html"
    assert "upper (ceiling)" in page.read_text() and "pool too small" in page.read_text()
    got = open_in_browser(page, "report-sweep")
    assert got["errors"] == []
    assert [g["traces"] for g in got["graphs"]] == [3, 3]                 # batch 1 and 8: three policies each


@needs_browser
def test_predicted_against_measured_on_one_axis(tmp_path, checkpoints, tiny_trace):
    from cmoe.executor.run import ExecConfig, execute, prepare
    from cmoe.executor.run import write_outputs as write_exec
    from cmoe.trace import bundle
    sim = _sim_folder(tmp_path, ("ondemand",), bundle.read(tiny_trace))
    cfg = ExecConfig(policies=("ondemand",), batch=1, tokens=6, device="cpu", quant="fp32", pool_gb=20)
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    write_exec(tmp_path / "exec", execute(w, cfg))
    page = build_report([sim, tmp_path / "exec"])
    assert page == tmp_path / "exec" / "compare.html"
    text = page.read_text()
    assert "predicted tok/s" in text and "measured tok/s" in text
    got = open_in_browser(page, "report-compare")
    assert got["errors"] == []
    pred = {s[4] for s in read_parquet(sim / "timeline-ondemand.parquet")}
    meas = {s[4] for s in read_parquet(tmp_path / "exec" / "timeline-ondemand.parquet")}
    layers, passes, timeline = got["graphs"]
    assert layers["names"] == ["agree (dotted: +-8%)"] * 3 + ["ondemand"] and timeline["traces"] == len(pred) + len(meas)
    assert passes["names"] == ["ondemand"]
    assert "predicted ms" in text


def test_span_limit_keeps_whole_passes_and_says_so():
    from cmoe.report.figures import limit_spans
    spans = [("sim", p, 0, "compute", "expert", 1, p * 10.0, p * 10.0 + 5, 1) for p in range(10) for _ in range(3)]
    groups, note = limit_spans([("a", spans), ("b", spans)], 20)
    assert [len(s) for _, s in groups] == [9, 9]                            # passes 0-2: 3 spans x 2 runs each
    assert note == "showing passes 0-2 of 10 (18 of 60 spans); raise --max-spans to see more"
    assert limit_spans([("a", spans)], 100) == ([("a", spans)], "")


def test_bad_report_input_is_one_line(tmp_path):
    with pytest.raises(CmoeError, match="does not exist"):
        build_report([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CmoeError, match="has no readable metrics.json"):
        build_report([tmp_path / "empty"])
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(CmoeError, match="is not a readable Parquet file"):
        build_report([tmp_path / "x.parquet"])


def test_cli_report_and_chrome_export(tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    folder = _sim_folder(tmp_path)
    r = CliRunner().invoke(app, ["report", str(folder), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0 and (tmp_path / "r.html").is_file()
    r = CliRunner().invoke(app, ["report", str(folder / "timeline-commit.parquet"), "--chrome", str(tmp_path / "c.json")])
    assert r.exit_code == 0
    doc = json.loads((tmp_path / "c.json").read_text())
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == len(read_parquet(folder / "timeline-commit.parquet"))
    r = CliRunner().invoke(app, ["report", str(folder), "--chrome", str(tmp_path / "c2.json")])
    assert r.exit_code == 2 and "--chrome takes one timeline .parquet file" in r.output


def test_commands_say_how_to_get_a_report_where_plotly_is_missing(tmp_path, monkeypatch):
    """The GPU image has no plotly: simulate --out still writes its outputs, exits 0 and says
    where to build the report."""
    import importlib.util

    from typer.testing import CliRunner

    from cmoe.cli.app import app
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, ["simulate", "--trace", "embedded", "--slots", "4", "--policy", "upper", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"no report here (plotly is not installed): run cmoe report {out} where it is" in r.output
    assert (out / "metrics.json").is_file() and not (out / "report.html").exists()


def test_report_embedded_writes_the_stats_page_here_not_into_the_package(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    from cmoe.data import default_trace
    before = sorted(p.name for p in default_trace().parent.iterdir())
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["report", "embedded"])
    assert r.exit_code == 0, r.output
    page = tmp_path / "embedded-stats.html"
    assert "trace statistics: tiny-moe" in page.read_text() and "rep_1st" in page.read_text()
    assert sorted(p.name for p in default_trace().parent.iterdir()) == before
    again = CliRunner().invoke(app, ["report", "embedded"])
    assert again.exit_code != 0 and "already exists" in again.output and "--force" in again.output
