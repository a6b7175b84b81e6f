"""`cmoe execute` as library calls: check everything that can be checked cheaply, then build the
host store and the model once, then run each policy on a fresh pool over the same passes.

Weights: `--model DIR` (a local checkpoint) or `--spec PRESET` (seeded random weights with the
preset's exact shapes). Routing: live (the model's own router, prompts from `--data`) or replayed
from `--trace` (a bundle or synthetic:PRESET): the router still runs and is read back, as in a
real run, and the trace's choice replaces its answer.
"""

from __future__ import annotations

import gc

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from cmoe.core.checkpoint import check_checkpoint
from cmoe.core.cpu_ref import cpu_ref_us
from cmoe.core.errors import CmoeError
from cmoe.executor.affinity import check_pin, pinned_host, run_setting
from cmoe.executor.checks import check_gpu_fits, check_trace_matches, mem_available, read_policy_json, resolve_device
from cmoe.executor.engine import Engine
from cmoe.executor.outputs import metrics, table, write_outputs  # noqa: F401  (re-exported)
from cmoe.executor.records import PassInput, RunLog
from cmoe.executor.replay_rows import replay_passes
from cmoe.executor.streams import run_events
from cmoe.executor.layout import expert_layout, slot_size
from cmoe.core.metrics import summary
from cmoe.policy.budget import expert_budget
from cmoe.policy.policies import POLICIES, any_trait, make_policy, needs_future, trait
from cmoe.policy.pool import PoolLayout, layout_for_policy
from cmoe.core.quant import QuantRecipe
from cmoe.core.spec import ModelSpec, preset
from cmoe.trace.bundle import Trace, fingerprint
from cmoe.core.timeline import STEP, OP, START, END, BYTES

DEFAULT_PROMPTS = ("The mixture of experts routes each token to a few of its experts.",
                   "def fibonacci(n):\n    if n < 2:\n        return n",
                   "Offloading keeps the experts in host memory and copies them over PCIe when needed.",
                   "A commit router predicts the next layer's experts from the current hidden state.")
ENGINES = ("lean", "hf")


@dataclass(frozen=True)
class ExecConfig:
    policies: tuple[str, ...] = ("commit",)
    pool_gb: float = 20.0
    batch: int = 1
    tokens: int = 256                 # decode steps
    device: str = "cuda"
    quant: str | None = None          # expert format; default: the trace's, else w4g128
    slots: int | None = None          # pin the slots per block instead of deriving them from pool_gb
    owa: bool = True                  # commit: OWA re-weighting (False: the prediction's own weights)
    teacher: tuple[int, ...] | None = None   # live mode: feed these tokens instead of the argmax (quality runs)
    seed: int = 0
    lead_us: float = 0.0              # calibration: GPU sleep queued ahead of each layer's experts (see Engine)
    include_prefill: bool = True
    engine: str = "lean"              # lean (graphs, static cache, one launch per layer) or hf (the reference)
    kernel: str = "auto"              # lean's int4 experts: fused (one launch per layer), loop (per expert), auto:
                                      # fused on CUDA; on a CPU the loop, whose torch int4 kernel is far faster
                                      # there than the fused kernel's plain-torch reference
    record_plans: bool = False
    keep_logits: bool = False
    progress: bool = False


@dataclass
class Workload:
    spec: ModelSpec
    device: torch.device
    fmt: str
    trace: Trace | None = None
    prompts: list[list[int]] | None = None
    model_dir: Path | None = None
    store: object = None
    model: object = None
    shims: list = field(default_factory=list)
    policy_layout: PoolLayout | None = None


@dataclass
class ExecResult:
    policy: str
    layout: PoolLayout
    budget: dict
    log: RunLog
    metrics: dict
    logits: list = field(default_factory=list)


def budget_recipe(fmt: str) -> QuantRecipe:
    """What actually sits on the device: experts in `fmt`, everything else in bf16."""
    return QuantRecipe("executor", expert=fmt, attention="bf16", dense="bf16")


def prepare(*, spec_name: str | None, model_dir: Path | None, trace_src: str | None, data: Path | None,
            cfg: ExecConfig, policy_json: Path | None = None) -> tuple[Workload, ExecConfig]:
    """Every cheap check first (device, model, trace, pool, memory); no weights touched yet."""
    from cmoe.trace.load import load_trace
    if (spec_name is None) == (model_dir is None):
        raise CmoeError("pass exactly one of --spec PRESET (random weights at its shapes) or --model DIR (a checkpoint)")
    if cfg.engine not in ENGINES:
        raise CmoeError(f"unknown engine '{cfg.engine}': choose from {', '.join(ENGINES)}")
    if cfg.kernel not in ("auto", "fused", "loop"):
        raise CmoeError(f"unknown kernel '{cfg.kernel}': choose from auto, fused, loop")
    bad = [p for p in cfg.policies if p not in POLICIES]
    if bad:
        raise CmoeError(f"unknown policy '{bad[0]}': choose from {', '.join(POLICIES)}")
    if cfg.tokens < 1 or cfg.batch < 1:
        raise CmoeError("--tokens and --batch must be at least 1")
    check_pin()
    device = resolve_device(cfg.device)
    spec = preset(spec_name) if spec_name else check_checkpoint(model_dir, float_experts=True)
    layout_override = None
    if policy_json is not None:
        name, pool_gb, batch, layout_override = read_policy_json(policy_json, spec)
        cfg = replace(cfg, policies=(name,), pool_gb=pool_gb, batch=batch)
    trace = None
    if trace_src:
        trace = load_trace(trace_src, None, cfg.batch)
        check_trace_matches(trace, spec)
        from cmoe.trace.passes import check_predictions
        check_predictions(trace, cfg.policies)
    elif spec_name:
        raise CmoeError("random weights route at random: give --trace BUNDLE (or synthetic:PRESET) to replay routing")
    elif future := [p for p in cfg.policies if needs_future(p)]:
        raise CmoeError(f"policy {future[0]} reads the routing's future, which only a replayed trace has: "
                        f"pass --trace, or leave {future[0]} out of --policy")
    stored = None
    if model_dir is not None:
        from cmoe.core.checkpoint import executor_format
        stored = executor_format(model_dir, spec)
        if stored and cfg.quant and cfg.quant != stored:
            raise CmoeError(f"the checkpoint's experts are {stored} (quantized in the checkpoint), which the executor "
                            f"runs as stored: leave out --quant, or pass --quant {stored}")
    fmt = stored or cfg.quant or (trace.recipe.expert if trace is not None and trace.recipe.name != "checkpoint"
                                  else "w4g128")
    if fmt == "w4g128" and spec.hidden % 128 and device.type == "cpu":
        fmt = "w4g32"
    el = expert_layout(fmt, spec.hidden, spec.expert_ffn)
    prompts = None
    if trace is None:
        prompts = _prompts(model_dir, data, spec, cfg.batch)
    w = Workload(spec=spec, device=device, fmt=fmt, trace=trace, prompts=prompts, model_dir=model_dir,
                 policy_layout=layout_override)
    for p in cfg.policies:
        layout_for(w, cfg, p)                     # pool too small: fails here, before any weight moves
    _check_memory(w, cfg, slot_size(el))
    return w, cfg


def _prompts(model_dir: Path, data: Path | None, spec: ModelSpec, batch: int) -> list[list[int]]:
    from cmoe.trace.hf import tokenizer_for, read_prompts
    texts = read_prompts(data) if data is not None else list(DEFAULT_PROMPTS)
    if len(texts) < batch:
        raise CmoeError(f"batch {batch} needs at least {batch} prompts, the data has {len(texts)}")
    enc = tokenizer_for(model_dir, spec.vocab)
    return [enc(t)[:512] for t in texts[:batch]]


def max_len(w: Workload, cfg: ExecConfig) -> int:
    if w.prompts is not None:
        return max(len(p) for p in w.prompts) + cfg.tokens
    return w.trace.cache_slots


def layout_for(w: Workload, cfg: ExecConfig, policy: str) -> tuple[PoolLayout, dict]:
    spec = w.spec
    slot = slot_size(expert_layout(w.fmt, spec.hidden, spec.expert_ffn))
    budget = expert_budget(spec, budget_recipe(w.fmt), int(cfg.pool_gb * 1e9), cfg.batch, max_len(w, cfg))
    if w.policy_layout is not None and not trait(policy, "holds_all") and cfg.slots is None:     # a policy file's, as is
        if min(w.policy_layout.slot_bytes) < slot:
            raise CmoeError(f"the policy file's slots ({min(w.policy_layout.slot_bytes)} B) are smaller than one "
                            f"{w.fmt} expert ({slot} B): simulate with the same --quant")
        return w.policy_layout, budget
    return layout_for_policy(policy, [slot] * spec.num_moe_layers, spec.num_experts, spec.top_k,
                             budget["expert_bytes"], cfg.slots), budget


def _check_memory(w: Workload, cfg: ExecConfig, slot: int) -> None:
    spec = w.spec
    store_bytes = slot * spec.num_experts * spec.num_moe_layers
    twins = any_trait(cfg.policies, "cpu_experts") and w.device.type == "cuda"
    host_need = store_bytes * (2 if twins else 1)
    if w.device.type == "cpu":            # the pool and the model live in host memory too (fp32: twice bf16)
        host_need += max(layout_for(w, cfg, p)[0].used_bytes for p in cfg.policies)
        host_need += 2 * layout_for(w, cfg, cfg.policies[0])[1]["resident_bytes"]
    avail = mem_available()
    if avail is not None and host_need > avail:
        raise CmoeError(f"the host store needs {host_need / 1e9:.1f} GB of host memory but {avail / 1e9:.1f} GB is "
                        f"available: use a smaller model or free memory")
    if w.device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(w.device)
    need = {}
    for p in cfg.policies:
        layout, budget = layout_for(w, cfg, p)
        need[p] = layout.used_bytes + budget["resident_bytes"] + budget["kv_bytes"] + budget["workspace_bytes"]
    check_gpu_fits(need, cfg.pool_gb, free, torch.cuda.get_device_name(w.device))


def build(w: Workload, cfg: ExecConfig) -> None:
    """The long part: experts into the host store, non-expert weights onto the device."""
    from cmoe.executor.model import load_checkpoint_model, random_model
    from cmoe.executor.store import checkpoint_store, packing_for, random_store
    dtype = torch.bfloat16 if w.device.type == "cuda" else torch.float32
    twins = any_trait(cfg.policies, "cpu_experts")
    packing = packing_for(w.fmt, w.device, uses_fused(cfg, w.spec, w.device))
    if w.model_dir is None:
        w.store = random_store(w.spec, w.fmt, w.device, cfg.seed, cfg.progress, packing)
        if twins:
            w.store.build_cpu_twins(cfg.progress)
        w.model, w.shims = random_model(w.spec, w.device, dtype, cfg.seed)
    else:
        w.store, others = checkpoint_store(w.model_dir, w.spec, w.fmt, w.device, twins, cfg.progress, packing)
        w.model, w.shims = load_checkpoint_model(w.model_dir, w.spec, others, w.device, dtype)


def fusable(spec: ModelSpec) -> bool:
    """Whether the one-launch layer kernel takes these shapes (its tiled int4 layout packs in-features
    in runs of 32); other shapes run the per-expert loop."""
    return spec.hidden % 32 == 0 and spec.expert_ffn % 32 == 0


def uses_fused(cfg: ExecConfig, spec: ModelSpec, device: torch.device) -> bool:
    """Whether the lean engine runs int4 experts through the one-launch layer kernel."""
    if cfg.engine != "lean" or not fusable(spec) or cfg.kernel == "loop":
        return False
    return cfg.kernel == "fused" or device.type == "cuda"


def engine_for(w: Workload, cfg: ExecConfig, policy, record_plans: bool | None = None):
    from cmoe.executor.lean import LeanEngine
    cls = LeanEngine if cfg.engine == "lean" else Engine
    rp = cfg.record_plans if record_plans is None else record_plans
    return cls(w.model, w.shims, w.spec, w.store, policy, w.device, rp, cfg.owa, cfg.lead_us)


def new_cache(w: Workload, cfg: ExecConfig):
    if cfg.engine == "lean":
        from cmoe.executor.kv import StaticKV
        return StaticKV(cfg.batch, max_len(w, cfg), w.device)
    from transformers import DynamicCache
    return DynamicCache(config=w.model.config)


# --- passes -------------------------------------------------------------------------------------

def run_policy(w: Workload, cfg: ExecConfig, policy_name: str) -> ExecResult:
    from cmoe.trace.passes import popularity
    layout, budget = layout_for(w, cfg, policy_name)
    pop = popularity(w.trace) if w.trace is not None else [[0] * w.spec.num_experts for _ in range(w.spec.num_moe_layers)]
    passes = replay_passes(w, cfg) if w.trace is not None else None
    future = [p.needed for p, *_ in passes] if passes is not None else None
    policy = make_policy(policy_name, layout, w.spec.num_experts, pop, future)
    if (w.store.packing == "tiled") != uses_fused(cfg, w.spec, w.device):
        raise CmoeError(f"this host store is packed for the {'one-launch layer kernel' if w.store.packing == 'tiled' else 'per-expert loop'}"
                        f" but engine {cfg.engine} with kernel {cfg.kernel} runs the other: build it again")
    eng = engine_for(w, cfg, policy)
    dev = w.device
    cache = new_cache(w, cfg)
    # everything made so far (the model, the store, the replay's per-layer lists: ~550k objects at
    # batch 8) out of the collector's reach while the passes run: a full collection over them took
    # 190 ms on a 2-core host, and the H200 runs showed single stalls of ~300 ms in one run of three
    gc.freeze()
    finished = False
    try:
        try:
            # `CMOE_PIN_HOST`, off unless set; only a CUDA run of a GPU-only policy (`cmoe.executor.affinity`)
            with pinned_host(run_setting(dev.type == "cuda", trait(policy_name, "cpu_experts"))) as core:
                ref = cpu_ref_us()                     # the CPU's own speed around the passes, on their core
                logits_out = _passes(eng, w, cfg, cache, passes)
                ref = (ref, cpu_ref_us())
        finally:
            gc.unfreeze()
            eng.close()
        log = eng.finish()
        log.clock_epoch = eng.clock.epoch0
        log.host_core, log.cpu_ref_us = core, ref
        finished = True
    finally:
        if not finished:
            eng.release()                              # a run, or its finish, that raised: its device events destroyed
    if cfg.record_plans:
        log.slot_mismatches = eng.check_slots()
    del cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ExecResult(policy_name, layout, budget, log, metrics(log, w, cfg, policy_name, layout), logits_out)


def _passes(eng: Engine, w: Workload, cfg: ExecConfig, cache, passes) -> list:
    """Run every pass (a replay's, else live ones); the logits kept where `cfg.keep_logits`."""
    if passes is None:
        return _live(eng, w, cfg, cache)
    dev = w.device
    # every pass's inputs on the device before the timed loop: a replay knows them all, and a
    # live engine's come from its own argmax on the device, so copying them in the loop would
    # charge the engine a host step it does not have (on the H200 ~250 us a pass with the GPU idle)
    pins = [PassInput(i, p.decode, torch.as_tensor(ids, dtype=torch.long, device=dev),
                      torch.as_tensor(pos, dtype=torch.long, device=dev),
                      None, np.ones(ids.size, bool), rows) for i, (p, ids, pos, rows) in enumerate(passes)]
    eng.prepare(pins)
    _reserve(eng, w, cfg, len(pins))           # the timing events, made before timing
    logits_out = []
    for pin in pins:
        lg = eng.run_pass(pin, cache)
        if cfg.keep_logits:
            logits_out.append(lg.float().cpu())
    return logits_out


def _reserve(eng: Engine, w: Workload, cfg: ExecConfig, passes: int) -> None:
    """The run's timing events, made before timing (`streams.run_events`)."""
    spec = w.spec
    eng.clock.reserve_events(run_events(passes, eng.M, spec.num_experts, spec.top_k, cfg.batch, eng.spans_each_pass))

def _live(eng: Engine, w: Workload, cfg: ExecConfig, cache) -> list:
    dev = w.device
    B = cfg.batch
    L = max(len(p) for p in w.prompts)
    ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(w.prompts):                 # left padding
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
    out = []
    active = mask.cpu().numpy().reshape(-1).astype(bool)
    steps = cfg.tokens if cfg.teacher is None else min(cfg.tokens, len(cfg.teacher))
    _reserve(eng, w, cfg, 1 + steps)
    lg = eng.run_pass(PassInput(0, False, ids, pos, mask if not active.all() else None, active), cache)
    if cfg.keep_logits:
        out.append(lg.float().cpu())
    for s in range(steps):
        if cfg.teacher is None:
            nxt = lg.argmax(-1, keepdim=True)
        else:                                          # teacher forcing: the text's next token, every row
            nxt = torch.full((B, 1), cfg.teacher[s], dtype=torch.long, device=dev)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], 1)
        pos = pos[:, -1:] + 1
        lg = eng.run_pass(PassInput(s + 1, True, nxt, pos, mask if not active.all() else None, np.ones(B, bool)), cache)
        if cfg.keep_logits:
            out.append(lg.float().cpu())
    return out


def execute(w: Workload, cfg: ExecConfig) -> list[ExecResult]:
    if w.store is None:
        build(w, cfg)
    return [run_policy(w, cfg, p) for p in cfg.policies]
