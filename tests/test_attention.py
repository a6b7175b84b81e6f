"""The lean decode attention (`cmoe.executor.attention`) against the attention modules it stands
in for, on the CPU: for each covered family, a prefill through the module's own forward, then
decode steps through the module and through the lean step on a copy of the cache; the rotation
and the cache writes equal transformers' exactly in bf16, the outputs agree to fp32 rounding,
and the lean engine takes the lean step in every decode pass (and only there). The Triton
kernels run against the same references under Triton's interpreter where Triton is installed,
and on CUDA in the GPU tests."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from cmoe.executor import attention
from cmoe.executor.kv import StaticKV
from tests.conftest import tiny_config

COVERED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _model(family, dtype=torch.float32, clip=None):
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(family)
    cfg.num_hidden_layers = 1
    if clip is not None:
        cfg.clip_qkv = clip
    if family == "qwen2_moe":
        cfg.qkv_bias = True
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    if family == "qwen2_moe":
        with torch.no_grad():
            for p in (m.model.layers[0].self_attn.q_proj.bias, m.model.layers[0].self_attn.k_proj.bias):
                p.normal_(0, 0.5)
    return m


def _steps(model, fast: bool, B=2, n=5, steps=3):
    """Prefill n tokens (row 0 left-padded by two), then `steps` decode steps, through layer 0's
    attention module; returns each decode step's output and the cache."""
    attn = model.model.layers[0].self_attn
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(11)
    dt = next(model.parameters()).dtype
    kv = StaticKV(B, n + steps, torch.device("cpu"))
    mask_in = torch.ones(B, n, dtype=torch.long)
    mask_in[0, :2] = 0
    pos = (mask_in.cumsum(1) - 1).clamp(min=0)
    x = torch.randn(B, n, H, generator=gen).to(dt)
    with torch.no_grad():
        pe = model.model.rotary_emb(x, pos)
        attn(hidden_states=x, position_embeddings=pe, attention_mask=kv.prefill(n, mask_in), past_key_values=kv)
        outs = []
        for s in range(steps):
            kv.step()
            xs = torch.randn(B, 1, H, generator=gen).to(dt)
            p = pos[:, -1:] + 1 + s
            pe = model.model.rotary_emb(xs, p)
            outs.append(attn(hidden_states=xs, position_embeddings=pe, attention_mask=kv.decode_mask,
                             past_key_values=kv)[0])
    return outs, kv


@pytest.mark.parametrize("family", COVERED)
def test_lean_decode_attention_equals_the_module(family, monkeypatch):
    ref = _model(family, clip=2.0 if family == "olmoe" else None)
    lean = copy.deepcopy(ref)
    (fd,) = attention.install(lean, family, cuda=False)
    calls = []
    monkeypatch.setattr(attention, "attend", lambda *a: calls.append(1) or _attend(*a))
    a, kv_a = _steps(ref, fast=False)
    b, kv_b = _steps(lean, fast=True)
    assert len(calls) == 3                                # every decode step, never the prefill
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-5), (x - y).abs().max()
    assert torch.allclose(kv_a.keys[0], kv_b.keys[0], atol=1e-6) and torch.allclose(kv_a.values[0], kv_b.values[0], atol=1e-6)
    # the module's weights are views of the stacked projection: no copy, the same numbers
    qp = lean.model.layers[0].self_attn.q_proj.weight
    assert qp.data_ptr() == fd.w.data_ptr() and torch.equal(qp, ref.model.layers[0].self_attn.q_proj.weight)
    attention.uninstall([fd])
    assert "forward" not in lean.model.layers[0].self_attn.__dict__


_attend = attention.attend


def test_rotation_and_cache_writes_equal_transformers_in_bf16():
    from transformers.models.mixtral.modeling_mixtral import apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, L = 3, 8, 2, 16, 7
    q, k, v = (torch.randn(B, h, D, generator=gen).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    cos, sin = (torch.randn(B, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    keys, values = torch.zeros(B, Hkv, L, D, dtype=torch.bfloat16), torch.zeros(B, Hkv, L, D, dtype=torch.bfloat16)
    slot = torch.tensor([4])
    qr = attention.rope_write(q, k, v, cos, sin, keys, values, slot)
    q4, k4 = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    assert torch.equal(qr, q4[:, :, 0]) and torch.equal(keys[:, :, 4], k4[:, :, 0]) and torch.equal(values[:, :, 4], v)
    assert keys[:, :, :4].abs().sum() == 0 and keys[:, :, 5:].abs().sum() == 0


def test_families_it_does_not_cover_and_the_switch(monkeypatch):
    ds = _model("deepseek_v2")
    assert attention.install(ds, "deepseek_v2", cuda=False) == []
    partial = _model("mixtral")
    partial.config.partial_rotary_factor = 0.5
    assert attention.install(partial, "mixtral", cuda=False) == []
    monkeypatch.setenv("CMOE_FAST_ATTN", "0")
    assert attention.install(_model("mixtral"), "mixtral", cuda=False) == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter on the CPU)")
@pytest.mark.parametrize("one,split", [("1", "1"), ("1", "0"), ("0", "1"), ("1", "keys"), ("0", "keys")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention_equals_the_reference(dtype, one, split, monkeypatch):
    """The rotated keys equal transformers' bit for bit on CUDA (the interpreter's bf16 rounding
    differs); the output agrees with SDPA over the repeated cache to the dtype's rounding. In one
    launch, and in the two of CMOE_ROPE_ATTEND=0; with the keys split over programs (L = 70, 200
    and 700: 2, 4 and 11 runs of 64, the slot in the last or in an earlier run with empty runs
    after it), with the runs sized by the keys so far (CMOE_ATTN_SPLIT=keys: one run of up to 128
    keys, or 2 and 6 runs of 128 at 198 and 651 keys) and without (CMOE_ATTN_SPLIT=0). A second
    call on the same inputs gives the same output: the split's counters are back at zero."""
    import os
    monkeypatch.setenv("CMOE_ROPE_ATTEND", one)
    monkeypatch.setenv("CMOE_ATTN_SPLIT", split)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from cmoe.executor.kernels_triton.attention import decode_attention
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(9)
    from cmoe.executor.kernels_triton.attention import splits
    assert [splits(L, split) for L in (21, 70, 200, 2052)] == (
        [(1, 21), (2, 64), (4, 64), (11, 192)] if split != "0" else [(1, 21), (1, 70), (1, 200), (1, 2052)])
    assert splits(200) == splits(200, split)                   # no mode given: CMOE_ATTN_SPLIT's
    if split != "0":                                           # longer caches: at most 16 runs
        assert [splits(L, split) for L in (320, 2060, 9000)] == [(5, 64), (11, 192), (16, 576)]
    for B, Hq, Hkv, D, L, at in ((1, 32, 8, 128, 200, 197), (3, 4, 2, 8, 21, 18), (2, 6, 6, 48, 70, 67),
                                 (2, 8, 2, 64, 200, 100), (1, 8, 2, 32, 700, 650)):
        qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen).to(dtype).to(dev)
        q, k, v = (t.reshape(B, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
        cos, sin = (torch.randn(B, D, generator=gen).to(dtype).to(dev) for _ in range(2))
        keys = torch.randn(B, Hkv, L, D, generator=gen).to(dtype).to(dev)
        values = torch.randn(B, Hkv, L, D, generator=gen).to(dtype).to(dev)
        valid = torch.rand(B, L, generator=gen).to(dev) < 0.6
        slot = torch.tensor([at], device=dev)
        valid[:, at] = True
        valid[:, at + 1:] = False                     # the cache's rule: nothing past the slot is valid yet
        keys[:, :, at + 1:] = values[:, :, at + 1:] = float("nan")    # so the kernel must not read there
        k1, v1, k2, v2 = keys.nan_to_num(), values.nan_to_num(), keys.clone(), values.clone()   # the reference reads all
        ref = attention.attend(attention.rope_write(q, k, v, cos, sin, k1, v1, slot), k1, v1, valid, D ** -0.5)
        out = decode_attention(q, k, v, cos, sin, k2, v2, slot, valid, D ** -0.5)
        assert torch.equal(decode_attention(q, k, v, cos, sin, k2, v2, slot, valid, D ** -0.5), out)
        from cmoe.executor.kernels_triton import scratch
        assert all(int(cnt.abs().sum()) == 0 for cnt in scratch.counters("decode_attention"))
        assert torch.equal(v1.nan_to_num(), v2.nan_to_num())
        if dev == "cuda" or dtype == torch.float32:       # the interpreter rounds bf16 its own way
            assert torch.equal(k1.nan_to_num(), k2.nan_to_num())
        else:
            assert torch.allclose(k1.float(), k2.nan_to_num().float(), atol=3e-2, rtol=2e-2)
        assert out.isfinite().all()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 3e-2), (B, Hq, Hkv, D, L, err)   # bf16: p rounds too


def test_normed_runs_the_norm_first_where_it_cannot_fold(monkeypatch):
    """`FastDecode.normed` off CUDA (and so in CI) is the module's forward on norm(x), whatever
    CMOE_QKV_NORM says: the same output and the same cache as the two calls it stands for."""
    monkeypatch.setenv("CMOE_QKV_NORM", "1")
    model = _model("mixtral")
    (fd,) = attention.install(model, "mixtral", cuda=False)
    layer = model.model.layers[0]
    assert not fd.folds(layer.input_layernorm)
    B, n, H = 2, 4, model.config.hidden_size
    gen = torch.Generator().manual_seed(2)
    outs = []
    for fold in (True, False):
        kv = StaticKV(B, n + 1, torch.device("cpu"))
        mask_in = torch.ones(B, n, dtype=torch.long)
        pos = mask_in.cumsum(1) - 1
        x = torch.randn(B, n, H, generator=gen)
        gen.manual_seed(2)
        with torch.no_grad():
            pe = model.model.rotary_emb(x, pos)
            layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=kv.prefill(n, mask_in),
                            past_key_values=kv)
            kv.step()
            xs = torch.randn(B, 1, H, generator=torch.Generator().manual_seed(3))
            pe = model.model.rotary_emb(xs, pos[:, -1:] + 1)
            if fold:
                o = fd.normed(layer.input_layernorm, xs, pe, kv.decode_mask, kv)[0]
            else:
                o = layer.self_attn(hidden_states=layer.input_layernorm(xs), position_embeddings=pe,
                                    attention_mask=kv.decode_mask, past_key_values=kv)[0]
        outs.append((o, kv.keys[0].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    attention.uninstall([fd])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", ["1", "keys"])
def test_split_attention_replayed_in_a_graph(split, monkeypatch):
    """The split attention captured once and replayed as the slot moves over a cache of 1000 keys
    (16 programs a head of 64 keys; by keys, 1 to 8 runs of at least 128), the slot and mask
    updated in place between replays as the lean engine updates them: each replay's output
    agrees with one program a head (CMOE_ATTN_SPLIT=0) to bf16 rounding, and the counters are
    back at zero after every replay."""
    from cmoe.executor.kernels_triton import scratch
    from cmoe.executor.kernels_triton.attention import decode_attention
    monkeypatch.setenv("CMOE_ATTN_SPLIT", split)
    gen = torch.Generator(device="cuda").manual_seed(4)
    B, Hq, Hkv, D, L = 2, 8, 2, 128, 1000
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v = (t.reshape(B, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
    cos, sin = (torch.randn(B, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    keys = torch.randn(B, Hkv, L, D, generator=gen, device="cuda").to(torch.bfloat16)
    values = torch.randn(B, Hkv, L, D, generator=gen, device="cuda").to(torch.bfloat16)
    slot = torch.tensor([0], device="cuda")
    valid = torch.zeros(B, L, dtype=torch.bool, device="cuda")

    def at(s):
        slot.fill_(s)
        valid.zero_()
        valid[:, :s + 1] = True
    at(5)
    decode_attention(q, k, v, cos, sin, keys, values, slot, valid, D ** -0.5)      # warm-up: the scratch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_attention(q, k, v, cos, sin, keys, values, slot, valid, D ** -0.5)
    for s in (5, 127, 128, 300, 640, 999):
        at(s)
        g.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("CMOE_ATTN_SPLIT", "0")
        ref = decode_attention(q, k, v, cos, sin, keys.clone(), values.clone(), slot, valid, D ** -0.5)
        monkeypatch.setenv("CMOE_ATTN_SPLIT", split)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, (s, err)
        assert all(int(c.abs().sum()) == 0 for c in scratch.counters("decode_attention")), s
