"""Routing logs from vLLM (and SGLang) and Megatron's RouterTracer, into bundles and back."""

import json

import numpy as np
from typer.testing import CliRunner

from cmoe.cli.app import app
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.trace import bundle
from cmoe.trace.bundle import DECODE, PREFILL
from cmoe.trace.logs import export_vllm, import_log
from cmoe.trace.synthetic import SyntheticParams, generate

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_a_vllm_round_trip_loses_nothing_the_format_holds(tmp_path):
    spec = preset("deepseek-v2-lite")                      # a dense first layer: a zero row in vLLM's array
    t = generate(spec, recipe("w4a16"), SyntheticParams(requests=3, prompt_len=5, decode_len=7))
    files = export_vllm(t, tmp_path / "v")
    a = np.load(files[0])
    assert a.dtype == np.int32 and a.shape == (12, spec.num_layers, spec.top_k) and not a[:, 0].any()
    back = import_log(tmp_path / "v", spec, recipe("w4a16"), prompt_tokens=5)
    order = np.lexsort((t.step, t.request))
    for k in ("experts", "request", "step", "phase"):
        assert np.array_equal(getattr(back, k), getattr(t, k)[order]), k
    assert (back.pred_experts == -1).all() and np.allclose(back.weights, 1 / spec.top_k)
    assert back.source["kind"] == "vllm" and back.source["prompt_tokens"] == 5


def test_a_megatron_log_becomes_a_bundle_that_stats_and_simulate_read(tmp_path):
    spec = preset("mixtral-8x7b")
    rng = np.random.default_rng(0)
    log = tmp_path / "router-rank0.jsonl"
    want = {}
    with open(log, "w") as f:
        for step in (0, 1):
            for layer in range(1, spec.num_layers + 1):        # 1-based, as Megatron numbers layers
                top = np.stack([rng.choice(8, 2, replace=False) for _ in range(6)]).tolist()
                want[(step, layer)] = top
                f.write(json.dumps({"step": step, "stage": 0, "block": 0, "layer": layer, "rank": 0,
                                    "num_tokens": 6, "topk": 2, "top_indices": top}) + "\n")
    r = _cli("trace", "--import", log, "--spec", "mixtral-8x7b", "--out", tmp_path / "b")
    assert r.exit_code == 0, r.output
    t = bundle.read(tmp_path / "b")
    assert t.num_tokens == 12 and t.request.tolist() == [0] * 6 + [1] * 6
    assert t.phase.tolist() == [PREFILL] + [DECODE] * 5 + [PREFILL] + [DECODE] * 5      # first token: the prompt
    assert t.experts[7, 3].tolist() == want[(1, 4)][1]
    assert _cli("stats", tmp_path / "b").exit_code == 0
    r = _cli("simulate", "--trace", tmp_path / "b", "--policy", "upper,ondemand,oracle", "--pool-gb", "20")
    assert r.exit_code == 0, r.output
    r = _cli("simulate", "--trace", tmp_path / "b", "--policy", "commit", "--pool-gb", "20")
    assert r.exit_code == 2 and r.output.strip().startswith("error: policy commit needs next-layer predictions")


def test_bad_logs_are_one_line(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((4, 3, 2), np.int32))
    cases = [
        (["--import", tmp_path / "a.npy", "--spec", "mixtral-8x7b", "--prompt-tokens", "1"], "needs [tokens, 32 layers, top-2]"),
        (["--import", tmp_path / "a.npy", "--spec", "mixtral-8x7b"], "pass --prompt-tokens N"),
        (["--import", tmp_path / "a.npy"], "pass one of --spec PRESET or --model DIR"),
        (["--import", tmp_path / "nothing.npy", "--spec", "mixtral-8x7b"], "does not exist"),
        (["--export", "parquet", "--trace", "embedded", "--out", tmp_path / "x"], "cmoe writes the vllm format"),
    ]
    for args, frag in cases:
        r = _cli("trace", *args, "--out", tmp_path / "o") if "--out" not in args else _cli("trace", *args)
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and frag in lines[0], (args, r.output)
        assert not (tmp_path / "o").exists() and not (tmp_path / "x").exists()
