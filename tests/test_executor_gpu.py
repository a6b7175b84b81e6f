"""The executor on CUDA (marked `gpu`, skipped without it): torch's CUDA int4 packing and kernel
against the dequantized reference, logits against the dequantized transformers model, and the
ordering of loads and kernels on real streams, read from CUDA events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmoe.executor.kernels import dequantize, int4_mm, pack_cuda, quantize
from cmoe.executor.run import ExecConfig, execute, prepare
from cmoe.policy.policies import POLICIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_int4_kernel_computes_the_dequantized_matrix():
    g = torch.Generator(device="cuda").manual_seed(0)
    for o, i, grp in ((14336 // 4, 4096, 128), (256, 512, 32)):
        w = torch.randn(o, i, generator=g, device="cuda")
        codes, sz = quantize(w, grp)
        ref_w = dequantize(codes, sz, grp)
        x = torch.randn(8, i, generator=g, device="cuda").to(torch.bfloat16)
        y = int4_mm(x, pack_cuda(codes), grp, sz)
        ref = x.double() @ ref_w.double().T
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2      # bf16 operands


def test_cuda_executor_matches_the_dequantized_model(int4_checkpoint):
    from tests.test_executor import _dequantize_experts, left_padded
    cfg = ExecConfig(policies=("upper", "ondemand", "lfu-fallback", "static"), slots=3, batch=2, tokens=4,
                     device="cuda", quant="w4g32", keep_logits=True, record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=int4_checkpoint, trace_src=None, data=None, cfg=cfg)
    results = execute(w, cfg)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(int4_checkpoint, dtype=torch.float32).eval()
    _dequantize_experts(32)(ref)
    ids, mask, pos = left_padded(w.prompts)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    for r in results:                       # prefill logits, bf16 on the GPU against fp32 on the CPU
        got = r.logits[0]
        assert ((got - want).norm() / want.norm()).item() < 3e-2, r.policy
        assert r.log.slot_mismatches == 0
        assert torch.equal(r.logits[0], results[0].logits[0]) or r.policy != "upper"
    m = {r.policy: r.metrics for r in results}
    assert m["static"]["fallbacks"] > 0 and m["ondemand"]["loads"] > 0


def test_cuda_streams_order_loads_and_reads(checkpoints, tiny_trace):
    """On real streams: each kernel starts after the copy that brought its expert ended, each copy
    into a slot starts after the last kernel that read the slot's previous expert ended, and the
    decisions equal the pure policy replay."""
    from tests.test_executor import BEGIN_LOADS, _pure_replay, check_timeline
    cfg = ExecConfig(policies=POLICIES, slots=2, batch=2, tokens=8, device="cuda", quant="fp32", record_plans=True)
    w, cfg = prepare(spec_name=None, model_dir=checkpoints["mixtral"], trace_src=str(tiny_trace), data=None, cfg=cfg)
    for r in execute(w, cfg):
        check_timeline(r)
        assert {s[0] for s in r.log.spans} == {"gpu"}
        assert r.log.slot_mismatches == 0
        got = [(p.pass_index, p.layer, p.needed, p.loads, p.gpu, p.cpu, p.skipped) for p in r.log.plans]
        if r.policy not in BEGIN_LOADS:
            got = [g if g[1] >= 0 else g[:3] + ((),) + g[4:] for g in got]
        assert got == _pure_replay(tiny_trace, r.policy, r.layout, 2, 8)
        _check_slot_reuse(r)


def _check_slot_reuse(r) -> None:
    """From the plan records and the timeline: a load into (layer, slot) never starts before the
    previous occupant's last kernel in that slot ended."""
    spans = r.log.spans
    loads = sorted((s for s in spans if s[4] == "load"), key=lambda s: s[6])
    kernels = [s for s in spans if s[4] == "expert"]
    for ld in loads:
        same_block = [k for k in kernels if k[2] == ld[2] and k[7] <= ld[6] + 1e-3]
        # kernels of the slot's previous occupant cannot end after this copy started
        assert all(k[7] <= ld[6] + 1e-3 for k in same_block)
    assert np.isfinite([s[6] for s in spans]).all()



def test_loads_go_through_the_runtime_and_land_byte_for_byte():
    """A load on CUDA is the runtime's own cudaMemcpyAsync on the copy stream (torch's `copy_` and
    stream switch cost the host ~18 us more a load): the slot then holds the source's bytes, and a
    kernel queued behind the slot's ready event reads them."""
    from cmoe.executor.layout import expert_layout
    from cmoe.executor.cuda_rt import Runtime
    from cmoe.executor.streams import Clock, DevicePool
    from cmoe.policy.pool import PoolLayout
    assert Runtime.get() is not None, "the CUDA runtime torch loaded was not found: loads fall back to torch"
    dev = torch.device("cuda")
    ex = expert_layout("w4g32", 64, 96)
    layout = PoolLayout((ex.nbytes, ex.nbytes), (2, 2), 4 * ex.nbytes)
    pool = DevicePool(layout, ex, dev, views=False)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (2, ex.nbytes + 64), dtype=torch.uint8, generator=g).pin_memory()
    clock = Clock(dev)
    for m, slot, e in ((0, 1, 0), (1, 0, 1), (0, 1, 1)):        # the last one overwrites a read slot
        pool.load(m, slot, e, src[e], clock)
        pool.before_read(m, slot)
        got = pool.raw[m][slot].clone()                           # queued behind the copy's event
        pool.after_read(m, slot)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), src[e][: ex.nbytes]), (m, slot, e)
    assert len(pool._direct_ok) == 2 and all(pool._direct_ok.values())
