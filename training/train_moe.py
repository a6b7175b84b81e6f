"""Train the small Mixtral-style MoE that cmoe embeds as its default model.

Corpus: CPython's standard library sources (every .py file under the running interpreter's
stdlib, site-packages excluded), byte-level (vocab 256: the tracer's byte fallback reads it with
no tokenizer). A file is held out when crc32(its relative path) % 10 == 0, so the split is fixed.
Model: 8 layers, hidden 128, 8 experts of ffn 256, top-2, 4 heads (2 KV heads), with Mixtral's
load-balancing loss; about 6.8M parameters, 13.5 MB in bf16 safetensors (under 16 MiB).

    python training/train_moe.py --out cmoe/data/tiny-moe --minutes 20 [--device cuda] [--resume]

What ships (training.json's settings say): trained on the lent H200 from the Python 3.11.7
standard library carried as a tarball (`--corpus` of the unpacked folder: the held-out split
depends only on paths relative to it), with a balancing loss per layer (`--layer-balance`): the first,
CPU-trained model had only transformers' loss, which balances all layers' choices together,
and its layers 1-2 sent nearly every byte to one expert.

Writes the checkpoint (bf16 safetensors, config.json) and training.json: settings, corpus, loss
curve (train and held-out, nats per byte) and the held-out unigram baseline. Seeded: on the CPU
the same settings and corpus give the same model; on a GPU the backward pass's atomic adds
make two runs differ in the last bits.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def is_heldout(root: Path, p: Path) -> bool:
    return zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0


def corpus(root: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    files = source_files(root)
    train, held = [], []
    for p in files:
        (held if is_heldout(root, p) else train).append(p.read_bytes() + b"\n")
    tr = np.frombuffer(b"".join(train), dtype=np.uint8)
    ho = np.frombuffer(b"".join(held), dtype=np.uint8)
    return tr, ho, {"root": str(root), "files": len(files), "train_bytes": int(tr.size), "heldout_bytes": int(ho.size),
                    "heldout_files": len(held)}


def unigram_nats(train: np.ndarray, held: np.ndarray) -> float:
    """Cross-entropy of the held-out bytes under the training bytes' frequencies (add-one)."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1
    p = counts / counts.sum()
    return float(-np.log(p[held]).mean())


def model_config(aux_coef: float = 0.02):
    import transformers as tf
    return tf.MixtralConfig(vocab_size=256, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=1024, output_router_logits=True, router_aux_loss_coef=aux_coef,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def windows(data: np.ndarray, n: int, seq: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, data.size - seq - 1, n)
    return torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64))


def balance_loss(router_logits, top_k: int) -> torch.Tensor:
    """Switch/Mixtral load balancing, per layer, averaged over layers: E * sum_i f_i * P_i with f_i
    the share of the layer's top-k choices that go to expert i and P_i its mean router probability.
    transformers' own loss concatenates every layer's logits first, so one layer's skew can be
    cancelled by another's: the first embedded model kept layers 1-2 on one expert under it."""
    losses = []
    for logits in router_logits:                                   # [tokens, E] per layer
        probs = torch.softmax(logits.float(), -1)
        E = probs.shape[-1]
        chosen = torch.nn.functional.one_hot(probs.topk(top_k, -1).indices, E).sum(1).float()   # [tokens, E]
        losses.append(E * (chosen.mean(0) / top_k * probs.mean(0)).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def heldout_loss(model, held: np.ndarray, seq: int, device, n: int = 64) -> float:
    model.eval()
    x = windows(held, n, seq, np.random.default_rng(1234)).to(device)   # the same windows every time
    out = model(input_ids=x[:, :-1], labels=x[:, :-1], output_router_logits=False)
    model.train()
    # labels are shifted inside the model: this is the next-byte loss over seq - 1 positions
    return float(out.loss)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--aux-coef", type=float, default=0.02,
                    help="weight of transformers' load-balancing loss, over all layers at once (0 to leave it out)")
    ap.add_argument("--layer-balance", type=float, default=0.0,
                    help="weight of the per-layer balancing loss (balance_loss); 0: none, as the first model")
    return ap.parse_args()


def main() -> None:
    a = _args()
    from transformers import MixtralForCausalLM
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    tr, ho, info = corpus(a.corpus)
    base = unigram_nats(tr, ho)
    log = {"settings": {k: str(v) for k, v in vars(a).items()}, "corpus": info, "unigram_heldout_nats": base,
           "curve": [], "device": a.device, "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    start_step = 0
    if a.resume and (a.out / "training.json").is_file():
        model = MixtralForCausalLM.from_pretrained(a.out, dtype=torch.float32).to(dev)
        model.config.output_router_logits = True
        old = json.loads((a.out / "training.json").read_text())
        log["curve"] = old["curve"]
        start_step = old["curve"][-1]["step"] if old["curve"] else 0
    else:
        model = MixtralForCausalLM(model_config(a.aux_coef)).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = np.random.default_rng(a.seed + start_step)
    total = a.steps
    warm = 100
    t0 = time.perf_counter()
    step = start_step
    print(f"corpus: {info}; held-out unigram {base:.3f} nats/byte", flush=True)
    while step < total and time.perf_counter() - t0 < a.minutes * 60:
        lr = a.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        x = windows(tr, a.batch, a.seq, rng).to(dev)
        out = model(input_ids=x[:, :-1], labels=x[:, :-1])
        bal = balance_loss(out.router_logits, model.config.num_experts_per_tok) if a.layer_balance else None
        loss = out.loss if bal is None else out.loss + a.layer_balance * bal
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step == 1:
            h = heldout_loss(model, ho, a.seq, dev)
            aux = float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
            lm = float(out.loss.detach()) - model.config.router_aux_loss_coef * aux     # the next-byte loss alone
            log["curve"].append({"step": step, "train_nats": lm, "heldout_nats": h,
                                 "minutes": (time.perf_counter() - t0) / 60})
            print(f"step {step} train {lm:.3f} held-out {h:.3f} nats/byte ({(time.perf_counter() - t0) / 60:.1f} min)",
                  flush=True)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(a.out)
    log["heldout_nats_final"] = heldout_loss(model.float(), ho, a.seq, dev)
    (a.out / "training.json").write_text(json.dumps(log, indent=1))
    print(f"saved {a.out}: held-out {log['heldout_nats_final']:.3f} nats/byte against unigram {base:.3f}", flush=True)


if __name__ == "__main__":
    main()
