"""The L2 prefetch of the lean attention's weights (`cmoe.executor.prefetch`): what the environment
asks for and which bytes of each row it names, on the CPU; the kernel itself and its branch in a
captured graph on CUDA (marked `gpu`)."""

from __future__ import annotations

import pytest
import torch

from cmoe.core.errors import CmoeError
from cmoe.executor.prefetch import plan, row_segment


def test_plan_is_off_unless_asked_and_reads_the_fractions():
    assert plan({}) == {} and plan({"CMOE_L2_PREFETCH": "0", "CMOE_L2_O": "0.5"}) == {}
    assert plan({"CMOE_L2_PREFETCH": "1"}) == {"o": 1.0, "qkv": 0.25}
    assert plan({"CMOE_L2_PREFETCH": "1", "CMOE_L2_O": "0", "CMOE_L2_QKV": "0.5"}) == {"qkv": 0.5}
    assert plan({"CMOE_L2_PREFETCH": "1", "CMOE_L2_O": "0.75", "CMOE_L2_QKV": "0"}) == {"o": 0.75}


@pytest.mark.parametrize("var,text,msg", [("CMOE_L2_O", "half", "is not a number"),
                                          ("CMOE_L2_QKV", "1.5", "outside [0, 1]"),
                                          ("CMOE_L2_O", "-0.1", "outside [0, 1]")])
def test_plan_refuses_bad_fractions_in_one_line(var, text, msg):
    with pytest.raises(CmoeError) as e:
        plan({"CMOE_L2_PREFETCH": "1", var: text})
    assert msg in str(e.value) and var in str(e.value) and "\n" not in str(e.value)


def test_row_segment_names_the_first_part_of_each_row_in_16_byte_units():
    w = torch.zeros(6, 4096, dtype=torch.bfloat16)               # rows of 8192 bytes
    assert row_segment(w, 1.0) == (6, 8192, 8192)
    assert row_segment(w, 0.25) == (6, 8192, 2048)
    assert row_segment(w, 0.001) == (6, 8192, 16)                 # at least one unit: 8.192 -> 16
    assert row_segment(w, 0.3) == (6, 8192, 2464)                 # 2457.6 rounded up to 16s
    big = torch.zeros(8, 4104, dtype=torch.bfloat16)
    assert row_segment(big[:, :4096], 0.5) == (8, 8208, 4096)    # a view: the stride is the parent's
    assert row_segment(big[:, 1:4097], 1.0) == (0, 0, 0)          # rows start 2 bytes off the 16
    assert row_segment(torch.zeros(4, 12, dtype=torch.bfloat16), 1.0) == (0, 0, 0)   # 24-byte rows
    assert row_segment(w.t(), 1.0) == (0, 0, 0)                   # not row-major
    assert row_segment(torch.zeros(4, 8, 8), 1.0) == (0, 0, 0)    # not 2-D


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_branch_in_a_graph_leaves_values_and_joins():
    """The kernel over every row shape the lean engine gives it, eagerly and as a graph branch
    beside a matmul that reads the rows: the product is the one without the branch, bit for bit,
    and outside a capture `branch` launches nothing."""
    from cmoe.executor import prefetch as P
    calls = []
    real = P.prefetch
    P.prefetch = lambda w, f, **k: (calls.append((tuple(w.shape), f)), real(w, f, **k))[1]
    try:
        pf = P.Prefetcher({"o": 1.0, "qkv": 0.25}, torch.device("cuda"))
        w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 127, 128, 129, 6144):
            P.prefetch(w[:rows], 0.3)
        ref = x @ w.t()
        pf.branch("o", w)                                        # not capturing: nothing
        assert len(calls) == 6 and not pf.open
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            pf.branch("qkv", w)
            pf.branch("o", w[:4096])
            y = x @ w.t()
            pf.join()
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert calls[-2:] == [((6144, 4096), 0.25), ((4096, 4096), 1.0)] and not pf.open
        assert torch.equal(y, ref)
    finally:
        P.prefetch = real
