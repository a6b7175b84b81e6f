"""The tiled int4 layout and the MoE-layer reference on the CPU (no Triton needed): the layout's
bytes equal the recipe's, packing round-trips and puts each code where the kernels read it, the
kernels' arithmetic (dots of 128 + q per 16-k plane, affine part per group) equals the
dequantized matrix, and the reference layer computed from slot bytes equals the layer computed
from `cmoe.executor.kernels.dequantize` of the known codes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cmoe.core.errors import CmoeError
from cmoe.executor.kernels import dequantize
from cmoe.executor.layout import FORMATS, expert_layout, slot_size
from cmoe.executor.moe_kernel import (BLOCK_K, moe_forward, moe_reference, pack_tiled, read_expert, route_into,
                                      route_reference, tiled_layout, unpack_tiled, write_codes)
from cmoe.core.quant import expert_tensor_bytes
from cmoe.core.spec import preset

GROUPS = (32, 64, 128, 256)


def _codes_sz(n: int, k: int, g: int, gen: torch.Generator):
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.02 + 0.001,
                      torch.rand(k // g, n, generator=gen) - 0.5], -1).to(torch.bfloat16)
    return codes, sz


def test_tiled_layout_has_the_slot_bytes_of_the_executor_layout():
    mix = preset("mixtral-8x7b")
    for fmt in FORMATS[:4]:
        t, e = tiled_layout(fmt, mix.hidden, mix.expert_ffn), expert_layout(fmt, mix.hidden, mix.expert_ffn)
        assert t.nbytes == e.nbytes == sum(expert_tensor_bytes(mix, fmt).values())
        assert [(p.name, p.offset, p.nbytes) for p in t.parts] == [(p.name, p.offset, p.nbytes) for p in e.parts]
        assert slot_size(t) == slot_size(e)
    assert tiled_layout("w4g128", 4096, 14336).nbytes == 93_585_408
    with pytest.raises(CmoeError, match="w4g"):
        tiled_layout("bf16", 64, 64)


@pytest.mark.parametrize("k", [128, 256, 32, 64, 96, 160, 224, 416])
def test_pack_round_trips_and_fills_exactly_the_matrix_bytes(k):
    gen = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 16, (64, k), dtype=torch.int32, generator=gen)
    packed = pack_tiled(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 64 * k // 2
    assert torch.equal(unpack_tiled(packed, 64, k), codes)


def test_each_code_sits_where_the_kernel_reads_it():
    """main: nibble p of int32 word [b, n, j] is k = 128 b + 16 p + j; tail64: nibble p of int16
    word [n, j] is k = 128 kb + 16 p + j; tail32: nibble p of byte [n, j] is the last 32 k's 16 p + j."""
    n, k = 64, 2 * BLOCK_K + 96
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    raw = pack_tiled(codes)
    words = raw[: n * 2 * 64].view(torch.int32).reshape(2, n, 16).long() & 0xFFFFFFFF
    for b in range(2):
        for p in range(8):
            got = (words[b] >> (4 * p)) & 15
            assert torch.equal(got.int(), codes[:, 128 * b + 16 * p: 128 * b + 16 * p + 16])
    t64 = raw[n * 128: n * 128 + n * 32].view(torch.int16).reshape(n, 16).long() & 0xFFFF
    for p in range(4):
        assert torch.equal(((t64 >> (4 * p)) & 15).int(), codes[:, 256 + 16 * p: 256 + 16 * p + 16])
    t32 = raw[n * 160:].reshape(n, 16).long()
    for p in range(2):
        assert torch.equal(((t32 >> (4 * p)) & 15).int(), codes[:, 320 + 16 * p: 320 + 16 * p + 16])


def _kernel_arithmetic(x: torch.Tensor, raw: torch.Tensor, sz: torch.Tensor, n: int, k: int, g: int) -> torch.Tensor:
    """x @ W^T the way the Triton kernel computes it: per 16-k plane the dot of x with the bf16
    value 0x4300 | q (= 128 + q, exact), per group acc += s * dot + (z - 136 s) * sum(x)."""
    codes = unpack_tiled(raw, n, k)
    v = (codes | 0x4300).to(torch.int16).view(torch.bfloat16).double()       # 128 + q
    assert torch.equal(v, codes.double() + 128)
    s, z = sz.double()[..., 0], sz.double()[..., 1]                          # [k/g, n]
    xd = x.double()
    acc = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for grp in range(k // g):
        sl = slice(grp * g, (grp + 1) * g)
        dot = sum(xd[:, sl][:, p * 16:(p + 1) * 16] @ v[:, sl][:, p * 16:(p + 1) * 16].T for p in range(g // 16))
        xs = xd[:, sl].sum(-1, keepdim=True)
        acc += dot * s[grp] + xs * (z[grp] - 136 * s[grp])
    return acc


@pytest.mark.parametrize("g", GROUPS)
def test_the_kernels_arithmetic_equals_the_dequantized_matrix(g):
    gen = torch.Generator().manual_seed(g)
    k = 512 if g == 256 else (384 + 64 if g == 64 else 256 + 96 if g == 32 else 384)
    codes, sz = _codes_sz(64, k, g, gen)
    x = torch.randn(3, k, generator=gen)
    ref = x.double() @ dequantize(codes, sz, g).double().T
    got = _kernel_arithmetic(x, pack_tiled(codes), sz, 64, k, g)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6


def _pool(E: int, S: int, H: int, Fd: int, g: int, gen: torch.Generator):
    """S slots holding E experts' known codes at a permuted slot table; the codes and scales too."""
    lay = tiled_layout(f"w4g{g}", H, Fd)
    pool = torch.zeros(S, slot_size(lay), dtype=torch.uint8)
    perm = torch.randperm(S, generator=gen)[:E]
    table = perm.int()
    known = []
    for e in range(E):
        c13, s13 = _codes_sz(2 * Fd, H, g, gen)
        c2, s2 = _codes_sz(H, Fd, g, gen)
        write_codes(pool[int(perm[e])], lay, "w13", c13, s13)
        write_codes(pool[int(perm[e])], lay, "w2", c2, s2)
        known.append((dequantize(c13, s13, g), dequantize(c2, s2, g)))
    return lay, pool, table, known


def _by_hand(x, ids, wts, known, skip=()):
    out = torch.zeros(x.shape[0], known[0][1].shape[0], dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            if e < 0 or e >= len(known) or e in skip:
                continue
            w13, w2 = (w.double() for w in known[e])
            a, b = (w13 @ x[m].double()).chunk(2)
            out[m] += float(wts[m, j]) * (w2 @ (F.silu(a) * b))
    return out


@pytest.mark.parametrize("g,H,Fd", [(32, 192, 160), (32, 64, 224), (64, 192, 320), (128, 256, 384), (256, 512, 256)])
def test_reference_layer_from_slot_bytes_equals_the_layer_by_hand(g, H, Fd):
    gen = torch.Generator().manual_seed(11 + g)
    E, S, M, k = 5, 7, 6, 2
    lay, pool, table, known = _pool(E, S, H, Fd, g, gen)
    x = torch.randn(M, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).int()
    wts = torch.rand(M, k, generator=gen)
    ref = _by_hand(x, ids, wts, known)
    got = moe_reference(x, ids, wts, table, pool, lay, round_h=False).double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert torch.equal(moe_forward(x, ids, wts, table, pool, lay), moe_reference(x, ids, wts, table, pool, lay))
    # an expert without a slot (-1) and padding ids (-1) are skipped
    table2 = table.clone()
    table2[int(ids[0, 0])] = -1
    ids2 = ids.clone()
    ids2[1, 1] = -1
    ref2 = _by_hand(x, ids2, wts, known, skip={int(ids[0, 0])})
    got2 = moe_reference(x, ids2, wts, table2, pool, lay, round_h=False).double()
    assert ((got2 - ref2).norm() / ref2.norm()).item() < 1e-5


def test_read_expert_gives_back_the_codes_and_scales():
    gen = torch.Generator().manual_seed(3)
    lay, pool, table, known = _pool(2, 2, 128, 128, 64, gen)
    p = read_expert(pool[int(table[1])], lay)
    assert torch.equal(dequantize(p["w13"], p["w13_sz"], 64), known[1][0])
    assert torch.equal(dequantize(p["w2"], p["w2_sz"], 64), known[1][1])


def test_route_reference_sorts_pairs_stably_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]], dtype=torch.int32)
    r = route_reference(ids, 4)
    assert r["order"].tolist() == [3, 1, 2, 5, 0, 4]
    assert r["seg_expert"].tolist() == [0, 1, 2, 3]
    assert r["seg_start"].tolist() == [0, 1, 3, 4]
    assert r["seg_end"].tolist() == [1, 3, 4, 6]


@pytest.mark.parametrize("P,E", [(6, 4), (4096, 8), (3, 8), (700, 64)])
def test_route_into_writes_the_reference_tables(P, E):
    """The route for large pair counts (the prefill's): the same order and segments as
    route_reference, ids -1 (pairs without an expert) included, with no host sync."""
    gen = torch.Generator().manual_seed(P)
    ids = torch.randint(-1, E, (P,), generator=gen, dtype=torch.int32).reshape(-1, 1)
    A = min(P, E + 1)
    order, srt = torch.empty(P, dtype=torch.int32), torch.empty(P, dtype=torch.int32)
    seg_e, seg_s, seg_end = (torch.full((A,), 77, dtype=torch.int32) for _ in range(3))
    route_into(ids, order, srt, seg_e, seg_s, seg_end)
    ref = route_reference(ids, E)
    n = ref["seg_expert"].numel()
    assert torch.equal(order, ref["order"]) and torch.equal(srt, ids.reshape(-1)[ref["order"].long()])
    assert torch.equal(seg_e[:n], ref["seg_expert"]) and (seg_e[n:] == -1).all()
    assert torch.equal(seg_s[:n], ref["seg_start"]) and torch.equal(seg_end[:n], ref["seg_end"])
    assert (seg_s[n:] == 77).all() and (seg_end[n:] == 77).all()
