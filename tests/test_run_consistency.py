"""`cmoe run --device cpu` on the embedded model, as the README's main job runs it: the int4 experts
compute what the dequantized float model computes, and the predicted and measured tables count
the same loads, hits, fallbacks and skipped experts over the same passes."""

import json

import pytest
import torch

from cmoe.data import default_model
from cmoe.executor.kernels import dequantize, quantize
from cmoe.executor.replay_rows import replay_passes
from cmoe.executor.run import ExecConfig, execute, prepare
from cmoe.core.hw import PROFILES, HardwareProfile
from cmoe.policy.policies import POLICIES

EXACT = ("upper", "ondemand", "lru-prefetch", "lfu-fallback", "static")


def _reference_logits(model_dir, passes, group: int) -> list[torch.Tensor]:
    """Unmodified transformers with every expert dequantized from its int4 codes, fed the same
    tokens and forced to the same (replayed) routing: last-position logits per pass."""
    from transformers import AutoModelForCausalLM, DynamicCache
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    current = {}
    with torch.no_grad():
        for m, layer in enumerate(ref.model.layers):
            ex = layer.mlp.experts
            for e in range(ex.gate_up_proj.shape[0]):
                ex.gate_up_proj[e] = dequantize(*quantize(ex.gate_up_proj[e], group), group)
                ex.down_proj[e] = dequantize(*quantize(ex.down_proj[e], group), group)

            def routed(_mod, args, m=m):
                h = args[0]
                idx = torch.as_tensor(current["rows"]["experts"][:, m], dtype=torch.long)
                w = torch.as_tensor(current["rows"]["weights"][:, m], dtype=h.dtype)
                return (h, idx, w)
            ex.register_forward_pre_hook(routed)
    cache = DynamicCache(config=ref.config)
    out = []
    with torch.no_grad():
        for _p, ids, pos, rows in passes:
            current["rows"] = rows
            lg = ref(input_ids=torch.as_tensor(ids), position_ids=torch.as_tensor(pos), past_key_values=cache,
                     use_cache=True).logits[:, -1]
            out.append(lg)
    return out


def test_int4_main_job_picks_the_dequantized_models_next_tokens():
    cfg = ExecConfig(policies=EXACT, slots=4, pool_gb=20.0, batch=1, tokens=12, device="cpu", keep_logits=True)
    w, cfg = prepare(spec_name=None, model_dir=default_model(), trace_src="embedded", data=None, cfg=cfg)
    assert w.fmt == "w4g128"                       # what the main job runs: int4 experts
    ref = _reference_logits(default_model(), replay_passes(w, cfg), 128)
    want = [lg.argmax(-1).tolist() for lg in ref]
    for r in execute(w, cfg):
        assert [lg.argmax(-1).tolist() for lg in r.logits] == want, r.policy
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(r.logits, ref))
        assert err < 1e-4, (r.policy, err)


def _cpu_profile() -> HardwareProfile:
    """The executor on a CPU: the host copies, one copy stream in issue order."""
    from dataclasses import replace
    return replace(PROFILES["h200"], name="cpu-test", copy_on_host=True, copy_fifo=True)


@pytest.mark.slow
def test_predicted_and_measured_count_the_same_over_the_same_passes(tmp_path):
    from cmoe.pipeline import run_all
    prof = tmp_path / "cpu.json"
    prof.write_text(json.dumps(_cpu_profile().to_dict()))
    out = tmp_path / "run"
    run_all(out, spec_name=None, model_dir=None, trace_src=None, policies=tuple(POLICIES), pool_gb=20.0,
            batch=1, tokens=16, quant=None, device="cpu", profile=str(prof), echo=lambda *_: None)
    pred = {m["policy"]: m for m in json.loads((out / "predicted" / "metrics.json").read_text())}
    meas = {m["policy"]: m for m in json.loads((out / "measured" / "metrics.json").read_text())}
    keys = ("scope", "decode_passes", "decode_tokens", "loads", "prefill_loads", "bytes_moved", "hits", "late",
            "demand", "fallbacks", "skipped", "hit_rate")
    for p in POLICIES:
        assert {k: pred[p][k] for k in keys} == {k: meas[p][k] for k in keys}, p
        assert pred[p]["decode_passes"] == 16 and pred[p]["late"] == 0      # the host copies: nothing in flight
    assert pred["ondemand"]["demand"] > 0 and pred["commit"]["skipped"] > 0 and pred["static"]["fallbacks"] > 0
    assert pred["upper"]["hit_rate"] == 1.0 and pred["upper"]["loads"] == 0


def test_the_main_job_fits_a_screen_with_the_summary_first_and_json_on_request(tmp_path):
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    prof = tmp_path / "cpu.json"
    prof.write_text(json.dumps(_cpu_profile().to_dict()))
    base = ["run", "--device", "cpu", "--policy", "upper,ondemand,oracle", "--tokens", "4", "--profile", str(prof)]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) <= 12, r.output
    assert lines[0].startswith("the embedded model")
    assert lines[1].startswith("tiny-moe on cpu, batch 1, 4 decode tokens, w4g128 experts: fastest measured ")
    assert lines[2].split() == ["policy", "predicted", "measured", "error", "x", "upper", "x", "oracle", "hit",
                                "loads", "fallback", "skipped"]
    assert [ln.split()[0] for ln in lines[3:6]] == ["upper", "ondemand", "oracle"]
    assert any(ln.startswith("noise: ") for ln in lines)
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [p["policy"] for p in doc["policies"]] == ["upper", "ondemand", "oracle"]
    assert doc["policies"][0]["x_upper"] == 1.0 and doc["policies"][2]["x_oracle"] == 1.0
    meas = {m["policy"]: m for m in json.loads((tmp_path / "b" / "measured" / "metrics.json").read_text())}
    assert doc["policies"][1]["measured_tok_s"] == meas["ondemand"]["tokens_per_s"]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "c"), "--quiet"])
    assert r.exit_code == 0 and r.output == ""
    # more tokens than the trace's first batch decodes (the embedded trace: 64 a request): the runs' own count
    r = CliRunner().invoke(app, [*base[:4], "upper", "--tokens", "70", *base[7:], "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert "batch 1, 64 decode tokens (the trace's first batch ends there; 70 asked), w4g128" in r.output


def test_cmoe_run_says_when_the_profiles_openmp_wait_policy_is_not_the_runs(tmp_path, monkeypatch):
    """A profile whose CPU experts were measured with threads that spin, against runs under the
    default: the summary's noise line names it without -v (`omp_note`); with the same policy on
    both sides it says nothing."""
    from dataclasses import replace
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    from cmoe.executor import omp_wait
    monkeypatch.setattr(omp_wait, "_READ", "default")      # the runs: libgomp's default
    want = ("the profile's CPU experts were measured under OpenMP ACTIVE, the runs' ran under default: "
            "threads that spin or sleep between them moved them 1.45-1.91x on the lent H100s; calibrate under "
            "them")
    for pol, said in (("ACTIVE", True), ("", False)):
        prof = tmp_path / f"cpu{pol}.json"
        prof.write_text(json.dumps(replace(_cpu_profile(), omp_wait_policy=pol).to_dict()))
        r = CliRunner().invoke(app, ["run", "--device", "cpu", "--policy", "static", "--tokens", "4", "--profile",
                                     str(prof), "--out", str(tmp_path / f"r{pol}")])
        assert r.exit_code == 0, r.output
        noise = [ln for ln in r.output.splitlines() if ln.startswith("noise: ")]
        assert len(noise) == 1 and noise[0].endswith("; " + want) == said, noise
        pred = json.loads((tmp_path / f"r{pol}" / "predicted" / "metrics.json").read_text())
        meas = json.loads((tmp_path / f"r{pol}" / "measured" / "metrics.json").read_text())
        assert (pred[0]["omp_wait_policy"], meas[0]["omp_wait_policy"]) == (pol or None, "default")
        # no few-expert thresholds: the profile does not record them, and a CPU run captures no graphs
        assert (pred[0]["few_experts"], meas[0]["few_experts"]) == (None, None)


def test_cmoe_run_of_gpu_only_policies_does_not_judge_the_cpu_experts_repeats(tmp_path):
    """A profile whose calibration's CPU experts spread 30% (one token: 1.0, 1.5, 1.9 ms): a run of
    GPU-only policies reads its calibration as quiet, a CPU-expert policy's as noisy (`noise_of`)."""
    from typer.testing import CliRunner

    from cmoe.cli.app import app
    us = 1e-6
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_cpu_profile().to_dict()))
    cpu = {"unit": "tokens", "grows": True, "points": [[1, [1000 * us, 1900 * us, 1500 * us]]]}
    copies = {"unit": "bytes", "grows": True, "points": [[65536, [12 * us, 12.5 * us, 13 * us]]]}
    prof.with_suffix(".measurements.json").write_text(json.dumps({"repeats": {"H2D pinned": copies,
                                                                              "CPU expert": cpu}}))
    said = {}
    for pol in ("upper", "static"):
        r = CliRunner().invoke(app, ["run", "--device", "cpu", "--policy", pol, "--tokens", "4", "--profile",
                                     str(prof), "--out", str(tmp_path / pol)])
        assert r.exit_code == 0, r.output
        noise = [ln for ln in r.output.splitlines() if ln.startswith("noise: ")]
        assert len(noise) == 1, r.output
        said[pol] = noise[0].split("; ", 1)[1]
    assert said["upper"].startswith("calibration quiet (spreads within 25% or 10 us; widest 4.0% at H2D pinned "
                                    "64 KiB); one run")
    assert said["static"].startswith("calibration noisy: 1 point spread over 25% (worst 30.0% at CPU expert, "
                                     "1 tokens); one run")
    assert said["static"].endswith("recalibrate on a quiet machine before reading these errors")

