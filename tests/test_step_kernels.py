"""The lean engine's one-launch steps (`cmoe.executor.kernels_triton.steps`, `norm`, `gemv`) against
the torch operations they replace: the routers' softmax top-k (Mixtral's fp32 scores, Qwen's and
OLMoE's cast, with and without renormalisation), with and without the router's matmul, X_m's
residual sum, a layer's residual add with its norm, and the decode projections. On CUDA, or on the CPU under
Triton's interpreter (TRITON_INTERPRET=1) where Triton is installed; the CPU suite runs the
torch operations themselves (the engine uses them there)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on CUDA, or its interpreter (TRITON_INTERPRET=1)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _router(cls, E, k, norm, H=64):
    import transformers as tf
    if cls == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R
        cfg = tf.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=k)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as R
        cfg = tf.Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm)
    torch.manual_seed(E + k)
    r = R(cfg)
    torch.nn.init.normal_(r.weight, 0, 0.5)
    return r


@pytest.mark.parametrize("cls,E,k,norm", [("mixtral", 8, 2, True), ("qwen", 60, 4, False), ("qwen", 128, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_equals_the_router(cls, E, k, norm, dtype):
    from cmoe.executor.kernels_triton.steps import fuse_routers
    r = _router(cls, E, k, norm).to(DEV, dtype).eval()
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    with torch.no_grad():
        lg, w, idx = r(x)
        mods = fuse_routers(r)
        lg2, w2, idx2 = r(x)
    assert mods == [r]
    assert torch.equal(lg, lg2) and w2.dtype == w.dtype
    tol = 1e-6 if w.dtype == torch.float32 else 1e-2
    assert torch.allclose(w.float(), w2.float(), atol=tol, rtol=tol), (w.float() - w2.float()).abs().max()
    # the same experts, but equal logits (frequent in bf16 over many experts) may come in another
    # order (this kernel puts the lower id first): wherever the ids differ, the logits tie
    differ = idx != idx2
    assert torch.equal(lg.gather(1, idx)[differ], lg.gather(1, idx2)[differ])
    if dtype == torch.float32:
        assert torch.equal(idx, idx2)


@pytest.mark.parametrize("E,k,norm,H", [(8, 2, True, 4096), (60, 4, False, 2048), (128, 8, True, 2048),
                                        (8, 2, False, 200)])
def test_route_mm_topk_is_the_router_matmul_then_route_topk(E, k, norm, H):
    """The logits within one rounding of the float64 product (bf16 on CUDA: at most one ulp, either
    way; the interpreter's fp32: the fp32 sum's error), and the top k exactly `route_topk`'s on them."""
    from cmoe.executor.kernels_triton.steps import route_mm_topk, route_topk
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32     # the interpreter rounds bf16 its own way
    g = torch.Generator().manual_seed(E + H)
    x = torch.randn(5, H, generator=g).to(DEV, dt)
    W = (torch.randn(E, H, generator=g) * 0.05).to(DEV, dt)
    from cmoe.executor.kernels_triton import scratch
    lg, w, idx = route_mm_topk(x, W, k, norm, torch.float32)
    assert lg.dtype == dt and w.dtype == torch.float32 and idx.dtype == torch.int64
    assert all(not cnt.any() for cnt in scratch.counters("route_mm_topk"))   # the last programs reset them
    ref = x.double() @ W.double().T
    err = 1e-6 * (x.double().abs() @ W.double().abs().T)                 # the fp32 sum's own error
    if dt == torch.bfloat16:                                             # and one rounding to bf16
        err = err + torch.pow(2.0, torch.floor(torch.log2(ref.abs())) - 7)
    assert ((lg.double() - ref).abs() <= err).all()
    w2, idx2 = route_topk(lg, k, norm, torch.float32)
    # the same experts; the weights to the last bit of the softmax's sum, whose order the compiler
    # may choose differently in the two kernels
    assert torch.equal(idx, idx2) and torch.allclose(w, w2, rtol=1e-6, atol=0)
    lg3, w3, idx3 = route_mm_topk(x, W, k, norm, torch.float32)          # a second launch: same counters
    assert torch.equal(lg3, lg) and torch.equal(w3, w) and torch.equal(idx3, idx)
    _, wc, idxc = route_mm_topk(x, W, k, norm, dt)                      # Qwen's and OLMoE's cast scores
    w4, idx4 = route_topk(lg, k, norm, dt)
    assert wc.dtype == dt and torch.equal(idxc, idx4) and torch.allclose(wc.float(), w4.float(), rtol=1e-2, atol=0)


def test_route_mm_topk_will_not_make_its_counters_inside_a_capture():
    """Zeros made inside a CUDA graph capture would exist only in the graph's replays."""
    if DEV != "cuda":
        pytest.skip("needs CUDA graphs")
    from cmoe.executor.kernels_triton.steps import route_mm_topk
    x = torch.randn(3, 256, device=DEV, dtype=torch.bfloat16)
    W = torch.randn(12, 256, device=DEV, dtype=torch.bfloat16)     # a shape no other test uses
    with pytest.raises(RuntimeError, match="outside the CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            route_mm_topk(x, W, 2, True, torch.float32)


@pytest.mark.parametrize("mm", [False, True])
def test_a_fused_router_takes_its_matmul_in_for_a_few_rows_only(mm, monkeypatch):
    from cmoe.executor.kernels_triton import steps
    calls = []
    real = steps.route_mm_topk
    monkeypatch.setattr(steps, "route_mm_topk", lambda *a: (calls.append(a[0].shape[0]), real(*a))[1])
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    r = _router("mixtral", 8, 2, True).to(DEV, dt).eval()
    steps.fuse_routers(r, mm=mm)
    with torch.no_grad():
        for n in (1, 16, 17):
            lg, w, idx = r(torch.randn(n, 64, generator=torch.Generator().manual_seed(n)).to(DEV, dt))
            assert lg.shape == (n, 8) and idx.shape == (n, 2)
    assert calls == ([1, 16] if mm else [])


def test_route_topk_on_a_nan_row_still_names_real_experts():
    """An overflowed row (NaN logits) must not send an id past the last expert to the layer
    kernel's slot table (torch's topk never does)."""
    from cmoe.executor.kernels_triton.steps import route_topk
    lg = torch.randn(3, 60, generator=torch.Generator().manual_seed(1)).to(DEV)
    lg[1] = float("nan")
    lg[2, 7] = float("nan")
    w, idx = route_topk(lg, 4, True, torch.float32)
    assert ((idx >= 0) & (idx < 60)).all()
    assert 7 not in idx[2].tolist()                        # a NaN expert ranks last


@pytest.mark.parametrize("shared", [False, True])
def test_residual_sum_equals_the_adds(shared):
    from cmoe.executor.kernels_triton.steps import residual_sum
    g = torch.Generator().manual_seed(4)
    dt = torch.float32 if DEV == "cpu" else torch.bfloat16      # the interpreter rounds bf16 its own way
    mid = torch.randn(3, 1, 3000, generator=g).to(DEV, dt)
    acc = torch.randn(3, 3000, generator=g).to(DEV)
    sh = torch.randn(3, 1, 3000, generator=g).to(DEV, dt)
    y = acc.to(dt).view(mid.shape)
    ref = mid + (sh + y) if shared else mid + y
    out = torch.empty_like(mid)
    got = residual_sum(mid, acc.view(mid.shape), sh if shared else None, out)
    assert got is out and torch.equal(got, ref)


@pytest.mark.parametrize("n", [4096, 200])
def test_add_rms_norm_is_the_residual_add_then_the_norm(n):
    """mid equals torch's add exactly; the norm equals the module's to the last bit of its fp32 sum of
    squares (whose order differs), in bf16 on CUDA and in fp32 under the interpreter."""
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    from cmoe.executor.kernels_triton.norm import add_rms_norm
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32     # the interpreter rounds bf16 its own way
    g = torch.Generator().manual_seed(n)
    r = torch.randn(3, 1, n, generator=g).to(DEV, dt)
    a = torch.randn(3, 1, n, generator=g).to(DEV, dt)
    norm = MixtralRMSNorm(n, eps=1e-5).to(DEV, dt)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
        mid, y = add_rms_norm(r, a, norm)
        ref = norm(r + a)
    assert torch.equal(mid, r + a) and y.shape == ref.shape and y.dtype == ref.dtype
    tol = 1e-6 if dt == torch.float32 else 8e-3
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol), (y.float() - ref.float()).abs().max()
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(r, a[:, :, :-1], norm)


@pytest.mark.parametrize("M,N,K,bias", [(1, 64, 512, False), (5, 40, 300, True), (16, 33, 128, False)])
def test_gemv_is_the_projection(M, N, K, bias, monkeypatch):
    """`gemv` against the float64 product (bf16 on CUDA: within a rounding of the output; fp32 under
    the interpreter), uneven N and K tails, a bias; `linear` takes it on CUDA bf16 rows unless
    CMOE_GEMV=0, else it is F.linear itself."""
    import torch.nn.functional as F

    from cmoe.executor.kernels_triton import gemv as G
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g).to(DEV, dt)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEV, dt)
    b = torch.randn(N, generator=g).to(DEV, dt) if bias else None
    y = G.gemv(x, w, b, bk=64, stages=2)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    tol = 1e-5 if dt == torch.float32 else 8e-3
    assert y.shape == (M, N) and y.dtype == dt
    assert ((y.double() - ref).abs() <= tol * (1 + ref.abs())).all()
    monkeypatch.setenv("CMOE_GEMV", "0")
    assert torch.equal(G.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.delenv("CMOE_GEMV", raising=False)
    assert G.fits(x, w) == (DEV == "cuda")
    assert torch.equal(G.linear(x, w, b), G.gemv(x, w, b, *G.config(N)) if DEV == "cuda" else F.linear(x, w, b))


@pytest.mark.parametrize("N,K,bias", [(64, 512, False), (40, 300, True), (96, 4096, False)])
def test_gemv_with_the_norm_folded_in_is_the_norm_then_the_projection(N, K, bias):
    """`gemv(..., norm=)` at one row against `norm.rms_norm` then `gemv`: fp32 under the interpreter
    within rounding, bf16 on CUDA within a rounding of the normed row (the sum of squares may add in
    another order); both against the float64 norm and product. More than one row is refused, and
    `fits_norm` takes only one row with the norm's weight in x's dtype."""
    from cmoe.executor.kernels_triton import gemv as G
    from cmoe.executor.kernels_triton.norm import rms_norm
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    g = torch.Generator().manual_seed(N + K)
    x = (torch.randn(1, K, generator=g) * 3).to(DEV, dt)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEV, dt)
    b = torch.randn(N, generator=g).to(DEV, dt) if bias else None
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(DEV, dt)
    eps = 1e-5
    y = G.gemv(x, w, b, bk=64, stages=2, norm=(nw, eps))
    two = G.gemv(rms_norm(x, nw, eps), w, b, bk=64, stages=2)
    xd = x.double()
    ref = (nw.double() * xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + eps)) @ w.double().T
    ref = ref + (b.double() if bias else 0)
    # bf16: the normed row is rounded twice (as transformers rounds it), an error that grows with
    # sqrt(K) against the unrounded float64 product: 2 of 96 outputs past 2e-2 * (1 + |ref|) at
    # K = 4096 for the two launches as well (the H200, 2026-12-03). So the fold is held to the
    # float64 product of the rounded normed row at the plain GEMV's 8e-3, and to the unrounded one
    # at a tolerance scaled by the row's length.
    rounded = rms_norm(x, nw, eps).double() @ w.double().T + (b.double() if bias else 0)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    near = 1e-5 if dt == torch.float32 else 8e-3
    assert y.shape == (1, N) and y.dtype == dt
    assert torch.allclose(y.double(), two.double(), rtol=tol, atol=tol * ref.abs().max().item())
    assert ((y.double() - rounded).abs() <= near * (1 + rounded.abs())).all()
    assert ((y.double() - ref).abs() <= tol * (K / 512) ** 0.5 * (1 + ref.abs())).all()
    with pytest.raises(ValueError, match="one row"):
        G.gemv(x.repeat(2, 1), w, b, norm=(nw, eps))
    if DEV == "cuda":
        assert G.fits_norm(x, w, b, nw) and not G.fits_norm(x.repeat(2, 1), w, b, nw)
        assert not G.fits_norm(x, w, b, nw.float()) and not G.fits_norm(x, w, b, nw[:-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs a GPU")
@pytest.mark.parametrize("M", [1, 4])
def test_gemv_launched_early_equals_the_plain_launch(M, monkeypatch):
    """CMOE_PDL=1 (on sm_90 and later): the norm kernel signals early and the GEMV after it starts
    with its first weights, waiting for x; eagerly and over three replays of a captured graph, with
    and without the norm folded in, the products equal the plain launches' bit for bit (the same
    dots in the same order)."""
    from cmoe.executor.kernels_triton import gemv as G
    from cmoe.executor.kernels_triton.norm import rms_norm
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs sm_90")
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(6144, 4096, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(4096, generator=g, device="cuda")).to(torch.bfloat16)

    def step():
        y = G.gemv(rms_norm(x, nw, 1e-5), w, None, *G.config(6144))
        return y, (G.gemv(x, w, None, *G.config(6144), norm=(nw, 1e-5)) if M == 1 else y)
    monkeypatch.setenv("CMOE_PDL", "0")
    ref = step()
    monkeypatch.setenv("CMOE_PDL", "1")
    assert G.pdl_enabled(x.device)
    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(ref, eager, out):
        assert torch.equal(a, b) and torch.equal(a, c)
