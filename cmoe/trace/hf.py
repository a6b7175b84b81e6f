"""The tracer: run a local Hugging Face MoE checkpoint and record its routing.

For every token and MoE layer it records what the model's own router chose (forward hooks on
each block's `mlp.gate`, which in every supported family returns `(logits, weights, indices)`),
and the **commit prediction**: MoE layer m's router applied to the hidden state that exists while
the previous MoE layer runs, namely the normalised input of that layer's MLP (its
`post_attention_layernorm` output). With consecutive MoE layers that is decoder layer d-1; where
dense layers sit between (Qwen's sparse step), the prediction reaches further ahead, which is
when the executor can act on it. The first MoE layer uses the MLP input of the decoder layer
before it, or, when the model starts with an MoE layer, layer 0's `input_layernorm` output,
i.e. it is made before attention, as pre-attention predictors do.
With `depth` D > 1 the same hidden state also feeds the routers of the D-1 MoE layers after
that one: the prediction for layer m at distance k is layer m's router applied to the state that
predicts layer m-k+1 at distance 1 (`pred_ahead`, see `cmoe.trace.bundle`).

Prompts run one at a time: prefill, then greedy decode with a KV cache. Tokens come from the
checkpoint's tokenizer when it has one, else from bytes (id = byte value mod vocab), which is
what the small self-made checkpoints of the tests need.

Loading is a boundary: the checkpoint first passes `cmoe.core.checkpoint.check_checkpoint`; whatever
transformers then raises (a missing optional package included) becomes one line, and a model
whose weights transformers did not all find in the checkpoint (it would run on their random
initial values) is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cmoe.core.checkpoint import check_checkpoint, checkpoint_expert_bytes, detect_expert_format, safetensors_files
from cmoe.core.errors import CmoeError
from cmoe.core.quant import QuantRecipe, expert_bytes, recipe
from cmoe.core.spec import ModelSpec
from cmoe.trace.bundle import DECODE, PREFILL, Trace


@dataclass(frozen=True)
class TraceOptions:
    max_new_tokens: int = 32
    max_prompt_tokens: int = 512
    record_logits: bool = False
    device: str = "auto"
    quant: str = "w4a16"              # recipe for expert sizes, or "checkpoint" for stored sizes
    allow_pickle: bool = False
    progress: bool = True
    depth: int = 4                    # predictions for up to this many MoE layers ahead


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CmoeError("CUDA is not available on this machine: pass --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise CmoeError(f"unknown device '{name}': use auto, cpu or cuda")
    return torch.device(name)


_PIP_NAMES = {"google": "protobuf", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def loading_error(model_dir: Path, what: str, e: Exception) -> CmoeError:
    """One line for an error transformers (or safetensors) raised while loading `what`; a missing
    package says what to install."""
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:200]
    if isinstance(e, ModuleNotFoundError) and e.name:
        pkg = _PIP_NAMES.get(e.name.split(".")[0], e.name.split(".")[0])
        return CmoeError(f"loading the {what} in {model_dir} needs the Python package '{pkg}', which is not "
                         f"installed: pip install {pkg}")
    if isinstance(e, ImportError):
        pip = re.search(r"pip install [\w.\-\[\]]+", first)
        return CmoeError(f"loading the {what} in {model_dir} needs a package that is not installed ({first}): "
                         f"{pip.group(0) if pip else 'install it'}, then run again")
    return CmoeError(f"could not load the {what} in {model_dir}: {first}")


def hf_load(model_dir: Path, what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), a transformers loader, with its errors as one CmoeError line. Its own
    warnings (the multi-line load report) and progress bar are held back: the caller checks the
    loading info, and an error stays the one line it prints."""
    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging
    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args, **kwargs)
    except (ImportError, OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError,
            SafetensorError) as e:
        raise loading_error(model_dir, what, e) from None
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def load_model(model_dir: Path, device: torch.device, allow_pickle: bool = False, spec: ModelSpec | None = None):
    """Load a checkpoint through transformers (safetensors only unless pickle is allowed), after
    the boundary check (skipped when its `spec` is given); refused if transformers would leave any
    weight of the model at its random initial value."""
    from transformers import AutoModelForCausalLM
    if spec is None:
        spec = check_checkpoint(model_dir, allow_pickle)
    use_st = bool(safetensors_files(model_dir, allow_pickle))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, info = hf_load(model_dir, "checkpoint", AutoModelForCausalLM.from_pretrained, model_dir, dtype=dtype,
                          use_safetensors=use_st, output_loading_info=True)
    check_loading_info(model_dir, info)
    return model.to(device).eval(), spec


_QUANTIZER_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_scale_inv",
                       "weight_shape", "SCB", "absmax", "quant_map")


def check_loading_info(model_dir: Path, info: dict) -> None:
    """transformers' loading report: a weight it found nowhere in the checkpoint (it would keep its
    random initial value) or could not fit is refused, naming the first."""
    missing, bad = sorted(info.get("missing_keys") or ()), sorted(info.get("mismatched_keys") or ())
    if missing:
        quantized = sorted(k for k in info.get("unexpected_keys") or () if k.endswith(_QUANTIZER_SUFFIXES))
        fix = (f"the checkpoint stores quantized tensors (e.g. {quantized[0]}) but config.json does not say how "
               f"to read them: restore its quantization_config") if quantized else \
            "the checkpoint lacks them or config.json is not its own: re-download the checkpoint"
        raise CmoeError(f"could not load the checkpoint in {model_dir}: transformers found {len(missing)} of the "
                        f"model's weights nowhere in it (first: {missing[0]}), so they would keep random values; {fix}")
    if bad or info.get("error_msgs"):
        first = str(bad[0] if bad else info["error_msgs"][0]).splitlines()[0][:200]
        raise CmoeError(f"could not load the checkpoint in {model_dir}: {first}: is config.json its own?")


def prediction_source(layers, spec: ModelSpec, m: int):
    """The module whose output predicts MoE layer m: the MLP input (post-attention norm) of the
    previous MoE layer; for the first MoE layer, of the decoder layer before it, or layer 0's
    input norm when the model starts with an MoE layer. The executor commits from the same point."""
    d = spec.moe_layers
    if m > 0:
        return layers[d[m - 1]].post_attention_layernorm
    return layers[d[0] - 1].post_attention_layernorm if d[0] > 0 else layers[0].input_layernorm


class RouteRecorder:
    """Forward hooks that capture each MoE layer's routing and the commit prediction."""

    def __init__(self, model, spec: ModelSpec, record_logits: bool, record_certainty: bool = False, depth: int = 1):
        layers = model.model.layers
        self.spec, self.record_logits, self.record_certainty = spec, record_logits, record_certainty
        self.depth = max(1, min(depth, spec.num_moe_layers))
        self.gates = [layers[d].mlp.gate for d in spec.moe_layers]
        self._predicting = False
        self.buf: dict[str, list] = {}
        self.handles = []
        for m in range(spec.num_moe_layers):
            self.handles.append(self.gates[m].register_forward_hook(self._on_route(m)))
            self.handles.append(prediction_source(layers, spec, m).register_forward_hook(self._on_source(m)))

    def reset(self) -> None:
        M = self.spec.num_moe_layers
        self.buf = {"experts": [None] * M, "weights": [None] * M, "pred": [None] * M, "logits": [None] * M,
                    "certainty": [None] * M, "ahead": [[None] * self.depth for _ in range(M)]}

    @staticmethod
    def _sorted(weights: torch.Tensor, idx: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        w = weights.detach().float()
        order = torch.argsort(w, dim=-1, descending=True, stable=True)
        return (idx.gather(-1, order).cpu().numpy().astype(np.int16), w.gather(-1, order).cpu().numpy())

    def _on_route(self, m: int):
        def hook(_mod, _inp, out):
            if self._predicting:
                return
            logits, weights, idx = out
            self.buf["experts"][m], self.buf["weights"][m] = self._sorted(weights, idx)
            if self.record_logits:
                self.buf["logits"][m] = logits.detach().float().reshape(idx.shape[0], -1).cpu().numpy()
        return hook

    def _on_source(self, m: int):
        def hook(_mod, _inp, out):
            h = out.reshape(-1, out.shape[-1])
            logits, w, idx = self._early(m, h)
            self.buf["pred"][m] = self.buf["ahead"][m][0] = self._sorted(w, idx)[0]
            self._deeper(m, h)
            if not self.record_certainty:
                return
            # the predicting router's certainty: softmax mass of its top-k (CommitMoE's key quantity)
            p = torch.softmax(logits.detach().float().reshape(idx.shape[0], -1), -1)
            self.buf["certainty"][m] = p.topk(idx.shape[-1], -1).values.sum(-1).cpu().numpy()
        return hook

    def _early(self, j: int, h: torch.Tensor):
        """Layer j's router on an earlier hidden state (its own hook ignores this call)."""
        self._predicting = True
        try:
            with torch.no_grad():
                return self.gates[j](h)
        finally:
            self._predicting = False

    def _deeper(self, m: int, h: torch.Tensor) -> None:
        """The state that predicts layer m at distance 1 predicts layer m+k-1 at distance k."""
        for k in range(2, self.depth + 1):
            j = m + k - 1
            if j >= self.spec.num_moe_layers:
                break
            _, w, idx = self._early(j, h)
            self.buf["ahead"][j][k - 1] = self._sorted(w, idx)[0]

    def _ahead(self) -> np.ndarray:
        """[T, M, D, K] the predictions by distance, -1 where m < k-1 (no state that far back)."""
        first = self.buf["pred"][0]
        return np.stack([np.stack([a if a is not None else np.full_like(first, -1) for a in row], 1)
                         for row in self.buf["ahead"]], 1)

    def collect(self) -> dict[str, np.ndarray]:
        b = self.buf
        assert all(x is not None for x in b["experts"]), "a forward pass did not reach every MoE layer"
        out = {"experts": np.stack(b["experts"], 1), "weights": np.stack(b["weights"], 1).astype(np.float32),
               "pred_experts": np.stack(b["pred"], 1)}
        if self.depth > 1:
            out["pred_ahead"] = self._ahead()
        if self.record_logits:
            out["router_logits"] = np.stack(b["logits"], 1).astype(np.float32)
        if self.record_certainty:
            out["certainty"] = np.stack(b["certainty"], 1).astype(np.float32)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def read_prompts(path: Path) -> list[str]:
    """Prompts from a text file (one per non-empty line) or JSONL (`prompt` or `text` field)."""
    if not path.is_file():
        raise CmoeError(f"data file {path} does not exist: pass --data a .txt or .jsonl file of prompts")
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError:
                raise CmoeError(f"{path}:{i} is not valid JSON") from None
            text = obj if isinstance(obj, str) else (obj.get("prompt") or obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise CmoeError(f"{path}:{i} has no 'prompt' or 'text' string field")
            prompts.append(text)
    if not prompts:
        raise CmoeError(f"data file {path} holds no prompts")
    return prompts


def tokenizer_for(model_dir: Path, vocab: int):
    """text -> token ids: the checkpoint's tokenizer, or bytes (id = byte value mod vocab)."""
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer
        tok = hf_load(model_dir, "tokenizer", AutoTokenizer.from_pretrained, model_dir)
        return lambda s: tok(s, add_special_tokens=True)["input_ids"]
    return lambda s: [b % vocab for b in s.encode("utf-8")] or [0]


def _sizes(model_dir: Path, spec: ModelSpec, quant: str) -> tuple[QuantRecipe, list[list[int]]]:
    if quant == "checkpoint":
        return QuantRecipe("checkpoint", expert=detect_expert_format(model_dir, spec), attention="bf16"), \
            checkpoint_expert_bytes(model_dir, spec)
    rec = recipe(quant)
    return rec, expert_bytes(spec, rec)


def trace_checkpoint(model_dir: str | Path, data: str | Path, opts: TraceOptions = TraceOptions()) -> Trace:
    model_dir, data = Path(model_dir), Path(data)
    prompts = read_prompts(data)
    device = pick_device(opts.device)
    spec = check_checkpoint(model_dir, opts.allow_pickle)
    rec, sizes = _sizes(model_dir, spec, opts.quant)
    model, _ = load_model(model_dir, device, opts.allow_pickle, spec)
    encode = tokenizer_for(model_dir, spec.vocab)
    from transformers import DynamicCache
    from tqdm import tqdm
    rec_hooks = RouteRecorder(model, spec, opts.record_logits, depth=opts.depth)
    parts: list[dict] = []
    ids_all = [encode(p)[: opts.max_prompt_tokens] for p in prompts]
    total = sum(len(x) + opts.max_new_tokens for x in ids_all)
    try:
        with torch.no_grad(), tqdm(total=total, unit="tok", disable=not opts.progress, desc="trace") as bar:
            for r, ids in enumerate(ids_all):
                cache = DynamicCache(config=model.config)
                x = torch.tensor([ids], device=device)
                for s in range(opts.max_new_tokens + 1):
                    rec_hooks.reset()
                    logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
                    part = rec_hooks.collect()
                    n = x.shape[1]
                    start = 0 if s == 0 else len(ids) + s - 1
                    part.update(request=np.full(n, r, np.int32), step=np.arange(start, start + n, dtype=np.int32),
                                phase=np.full(n, PREFILL if s == 0 else DECODE, np.uint8),
                                token_ids=x[0].cpu().numpy().astype(np.int32))
                    parts.append(part)
                    bar.update(n)
                    if s == opts.max_new_tokens:
                        break
                    x = logits[:, -1:].argmax(-1)
    finally:
        rec_hooks.close()
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    src = {"kind": "hf", "model_dir": str(model_dir.resolve()), "family": spec.family, "device": device.type,
           "max_new_tokens": opts.max_new_tokens, "depth": rec_hooks.depth, "bytes_from": "checkpoint" if opts.quant == "checkpoint" else "recipe"}
    return Trace(**cat, spec=spec, recipe=rec, expert_bytes=sizes,
                 source={**src, "dataset": str(data.resolve()), "prompts": len(prompts)})
