"""Issue 17 on the GPU: GPTQ and AWQ checkpoints made by GPTQModel itself (on the CPU, here),
executed as stored on CUDA by the lean engine (CUDA graphs and the fused Triton layer kernel;
the reference engine refuses fp16 scales on CUDA and runs only in the CPU dry run), every pass's
logits held against the fp32 transformers model whose experts hold the library's own dequantized
weights.

Make the checkpoints on the CPU (GPTQModel is not on the GPU image and need not be):

    /tmp/gq/bin/python benchmarks/gptq_h200.py make --out .gq     # venv as in tests/test_gptq_library.py

then on the H200, carrying `.gq`:

    python3 benchmarks/gptq_h200.py run --src .gq --out $OUT/gptq-h200.json

Checks per (method, engine, policy): the store's tiled bytes dequantize to the library's weights
bit for bit (layer by layer, every expert), and every pass's last-position logits (prefill and 4
decode steps, batch 2) are within a relative L2 error of 3e-2 of the fp32 reference (the GPU runs
bf16 activations). The JSON holds every error, so the table in BENCHMARKS.md is read off it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("gptq", "awq")
POLICIES = ("upper", "ondemand", "lru-prefetch", "static", "commit", "adaptive")   # oracle needs a replayed trace
EXACT = {"upper", "ondemand", "lru-prefetch", "static"}   # routing unchanged: logits must match the reference
TOL = 3e-2


def make(out: Path) -> None:
    """The float source (tests' int4_checkpoint, seed 5, plus a word-level tokenizer), then GPTQModel's
    GPTQ and AWQ checkpoints of it, each with the library's dequantized expert weights beside it."""
    import os
    import subprocess
    import shutil

    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(5)
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256)
    out = out.resolve()
    src = out / "src"
    mark = out / ".gptq_h200"                        # only a folder this script made is replaced
    if out.exists() and any(out.iterdir()) and not mark.is_file():
        raise SystemExit(f"{out} is not empty and was not made by this script: choose another --out")
    shutil.rmtree(out, ignore_errors=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    mark.touch()
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2",
                            bos_token="t3").save_pretrained(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for method in METHODS:
        code = f"from tests.test_gptq_library import make; make({str(src)!r}, {str(out / method)!r}, {method!r})"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=out, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(out / "logs", ignore_errors=True)
    print(f"wrote {', '.join(str(out / m) for m in METHODS)}")


def _rel(a, b) -> float:
    return ((a.float().cpu() - b).norm() / b.norm()).item()


def check(src: Path, method: str, engine: str, device: str) -> list[dict]:
    """One method under one engine: bit-exact store weights, then each policy's logits per pass."""
    import torch
    from safetensors.torch import load_file

    from cmoe.executor.run import ExecConfig, execute, prepare
    from tests.test_executor import reference_logits
    from tests.test_gptq_checkpoint import expert_weights, replace_experts, store_weights
    path = src / method
    lib = torch.load(path / "library_weights.pt")
    cfg = ExecConfig(policies=POLICIES, slots=3, batch=2, tokens=4, device=device, keep_logits=True,
                     record_plans=True, engine=engine)
    w, cfg = prepare(spec_name=None, model_dir=path, trace_src=None, data=None, cfg=cfg)
    results = execute(w, cfg)                 # builds the store
    exact_bytes = all(torch.equal(a, b) for m, d in enumerate(w.spec.moe_layers) for e in range(w.spec.num_experts)
                      for a, b in zip(store_weights(w.store, m, e), expert_weights(lib, d, e)))
    others = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items() if ".experts." not in k}

    def apply(model):
        model.load_state_dict(others, strict=False)
        replace_experts(lib)(model)
    ref = reference_logits(src / "src", w.prompts, 4, apply)
    rows = []
    for r in results:
        errs = [_rel(a, b) for a, b in zip(r.logits, ref)]
        ok = exact_bytes and (max(errs) < TOL if r.policy in EXACT else errs[0] < TOL)
        rows.append({"method": method, "engine": engine, "policy": r.policy, "fmt": w.fmt,
                     "packing": w.store.packing, "bytes_exact": exact_bytes, "rel_err": errs,
                     "slot_mismatches": r.log.slot_mismatches, "ok": bool(ok and r.log.slot_mismatches == 0)})
    return rows


def run(src: Path, out: Path, device: str) -> int:
    import torch
    # on CUDA the reference engine refuses fp16 scales (torch's CUDA int4 kernel reads bf16 ones): lean only
    engines = ("lean",) if device == "cuda" else ("lean", "hf")
    rows = [row for method in METHODS for engine in engines for row in check(src, method, engine, device)]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "tol": TOL, "rows": rows}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(out)
    for r in rows:
        print(f"{r['method']:5} {r['engine']:4} {r['policy']:13} bytes_exact={r['bytes_exact']} "
              f"max_rel={max(r['rel_err']):.2e} prefill_rel={r['rel_err'][0]:.2e} ok={r['ok']}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="build the checkpoints with GPTQModel (CPU)")
    mk.add_argument("--out", type=Path, default=Path(".gq"), help="folder to write (default: .gq)")
    rn = sub.add_parser("run", help="execute them on CUDA and compare logits")
    rn.add_argument("--src", type=Path, default=Path(".gq"), help="folder `make` wrote (default: .gq)")
    rn.add_argument("--out", type=Path, default=Path("gptq-h200.json"), help="JSON to write")
    rn.add_argument("--device", default="cuda", help="cuda (the H200 run) or cpu (a dry run of the script)")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out)
        return 0
    return run(a.src, a.out, a.device)


if __name__ == "__main__":
    raise SystemExit(main())
