"""The SimPy model: exact timelines on hand-made cases, invariants and determinism on larger ones."""

from dataclasses import replace

import numpy as np
import pytest

from cmoe.core.errors import CmoeError
from cmoe.core.hw import H200, RTX4090, HardwareProfile
from cmoe.policy.policies import make_policy
from cmoe.policy.pool import PoolLayout
from cmoe.core.quant import recipe
from cmoe.sim.engine import Costs, Simulation
from cmoe.sim.run import SimConfig, simulate
from cmoe.core.spec import ModelSpec, preset
from cmoe.trace.bundle import DECODE, Trace
from cmoe.trace.passes import make_passes, popularity
from cmoe.trace.synthetic import SyntheticParams, generate

# 1 GB/s link: 1000 bytes take 1 us; expert kernels at 0.5 GB/s: 2 us; every layer's attention 10 us
FLAT = HardwareProfile(name="flat", gpu_mem_bytes=10**9, h2d_pinned=((1, 1.0),), d2h_pinned=((1, 1.0),),
                       h2d_pageable_gbps=1.0, copy_engines=1, hbm_gbps=1e12, matmul_tflops=1e12,
                       expert_gbps=(("int4", 0.5), ("int8", 0.5), ("bf16", 0.5)), launch_us=0.0,
                       layer_fixed_us=10.0, attn_us_per_token=0.0, cpu_expert_gbps=0.1, roundtrip_us=5.0)


def tiny_trace(layers, experts, pred, num_experts=2):
    """Hand-made decode trace of one request: experts/pred as [token][layer] top-1 lists."""
    M = len(layers)
    spec = ModelSpec(name="tiny", family="mixtral", num_layers=M, hidden=4, expert_ffn=4, num_experts=num_experts, top_k=1,
                     num_heads=1, num_kv_heads=1, head_dim=4, vocab=8, moe_layers=tuple(range(M)))
    T = len(experts)
    return Trace(experts=np.array(experts, np.int16)[..., None], weights=np.ones((T, M, 1), np.float32),
                 pred_experts=np.array(pred, np.int16)[..., None], request=np.zeros(T, np.int32),
                 step=np.arange(T, dtype=np.int32), phase=np.full(T, DECODE, np.uint8), spec=spec,
                 recipe=recipe("w4a16"), expert_bytes=[[1000] * num_experts] * M)


def run_tiny(t, policy, slots=1, profile=FLAT):
    M = t.spec.num_moe_layers
    layout = PoolLayout((1024,) * M, (slots,) * M, 1024 * slots * M)
    E = t.spec.num_experts
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4] * E] * M, expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=t.spec.moe_layers)
    p = make_policy(policy, layout, E, popularity(t))
    return Simulation(p, profile, costs, make_passes(t, 1), record_log=True).simulate()


def test_ondemand_one_layer_two_experts_by_hand():
    run = run_tiny(tiny_trace([0], [[0], [1], [0]], [[0], [1], [0]]), "ondemand")
    assert run.spans == [
        ("sim", 0, 0, "compute", "attention", -1, 0, 10, 0), ("sim", 0, 0, "compute", "expert", 0, 10, 12, 1000),
        ("sim", 1, 0, "compute", "attention", -1, 12, 22, 0), ("sim", 1, 0, "copy0", "load", 1, 22, 23, 1000),
        ("sim", 1, 0, "compute", "expert", 1, 23, 25, 1000),
        ("sim", 2, 0, "compute", "attention", -1, 25, 35, 0), ("sim", 2, 0, "copy0", "load", 0, 35, 36, 1000),
        ("sim", 2, 0, "compute", "expert", 0, 36, 38, 1000)]
    assert [p[3] for p in run.pass_us] == [12, 13, 13]
    assert run.loads == 2 and run.bytes_moved == 2000 and run.stall_us == 2


def test_commit_loads_the_next_layer_while_this_one_runs():
    t = tiny_trace([0, 1], [[0, 0], [0, 1]], [[0, 0], [0, 1]])
    run = run_tiny(t, "commit")
    assert run.spans[-5:] == [
        ("sim", 1, 0, "compute", "attention", -1, 24, 34, 0), ("sim", 1, 1, "copy0", "load", 1, 34, 35, 1000),
        ("sim", 1, 0, "compute", "expert", 0, 34, 36, 1000),
        ("sim", 1, 1, "compute", "attention", -1, 36, 46, 0), ("sim", 1, 1, "compute", "expert", 1, 46, 48, 1000)]
    assert run.stall_us == 0 and run.pass_us[-1][3] == 24
    ondemand = run_tiny(t, "ondemand")
    assert ondemand.pass_us[-1][3] == 25 and ondemand.stall_us == 1


def test_an_op_that_starts_while_a_copy_is_in_flight_runs_slower():
    """The commit case above with copy_compute_slowdown 0.5: layer 0's expert starts at 34 while
    layer 1's load (34-35) is in flight, so its 2 us take 3; layer 1's attention starts after the
    copy has landed and keeps its 10 us."""
    t = tiny_trace([0, 1], [[0, 0], [0, 1]], [[0, 0], [0, 1]])
    run = run_tiny(t, "commit", profile=replace(FLAT, copy_compute_slowdown=0.5))
    assert run.spans[-5:] == [
        ("sim", 1, 0, "compute", "attention", -1, 24, 34, 0), ("sim", 1, 1, "copy0", "load", 1, 34, 35, 1000),
        ("sim", 1, 0, "compute", "expert", 0, 34, 37, 1000),
        ("sim", 1, 1, "compute", "attention", -1, 37, 47, 0), ("sim", 1, 1, "compute", "expert", 1, 47, 49, 1000)]



def test_the_attention_side_has_its_own_slowdown_beside_a_copy():
    """The commit case with copies taking 4 us: layer 1's load (34-38) is in flight when layer 0's
    expert starts (2 us x 1.5 = 3: 34-37) and when layer 1's attention starts (10 us x 1.2 = 12:
    37-49); without its own factor the attention side takes the experts' (x 1.5 = 15)."""
    t = tiny_trace([0, 1], [[0, 0], [0, 1]], [[0, 0], [0, 1]])
    slow = replace(FLAT, copy_compute_slowdown=0.5, h2d_pinned=((1, 0.25),))
    run = run_tiny(t, "commit", profile=replace(slow, copy_attention_slowdown=0.2))
    assert run.spans[-4:] == [
        ("sim", 1, 0, "compute", "expert", 0, 34, 37, 1000), ("sim", 1, 1, "copy0", "load", 1, 34, 38, 1000),
        ("sim", 1, 1, "compute", "attention", -1, 37, 49, 0), ("sim", 1, 1, "compute", "expert", 1, 49, 51, 1000)]
    same = run_tiny(t, "commit", profile=slow)
    assert same.spans[-2][6:8] == (37, 52)
    assert slow.attention_slow == 1.5 and replace(slow, copy_attention_slowdown=0.0).attention_slow == 1.0


def test_a_read_back_beside_a_moving_load_takes_readback_copy_us_more():
    """lru-prefetch with 20 us copies: layer 1's prefetch (34-54) is still moving when its route
    step starts at 46 (pass 1) and layer 1's load (86-106) when it starts at 98 (pass 2): each route
    takes 3 us (a span the host's own time would not show here); the experts still wait for their
    loads, and with no such term there is no route span at all."""
    t = tiny_trace([0, 1], [[0, 0], [0, 1], [1, 0]], [[0, 0], [0, 1], [1, 0]])
    base = replace(FLAT, h2d_pinned=((1, 0.05),), copy_fifo=True, copy_compute_slowdown=0.0)
    run = run_tiny(t, "lru-prefetch", profile=replace(base, readback_copy_us=3.0))
    routes = [sp for sp in run.spans if sp[4] == "route"]
    assert routes == [("sim", 1, 1, "compute", "route", -1, 46, 49, 0), ("sim", 2, 1, "compute", "route", -1, 98, 101, 0)]
    assert ("sim", 1, 1, "compute", "expert", 1, 54, 56, 1000) in run.spans
    assert not [sp for sp in run_tiny(t, "lru-prefetch", profile=base).spans if sp[4] == "route"]

def test_a_launch_beside_a_moving_load_starts_launch_copy_us_later():
    """The same in fused launches (the lean executor's): pass 1's layer-0 launch is issued at 34,
    right after the prefetch of layer 1 (34-54) it plans, so its slot table's copy waits 3 us behind
    that load (expert at 37, not 34, and layer 1's attention after it); a launch that waits for its
    own load anyway (pass 1's layer 1, pass 2's both) starts as that load lands, as without the term."""
    t = tiny_trace([0, 1], [[0, 0], [0, 1], [1, 0]], [[0, 0], [0, 1], [1, 0]])
    base = replace(FLAT, h2d_pinned=((1, 0.05),), copy_fifo=True, copy_compute_slowdown=0.0, wave_gbps=0.5)
    run = run_tiny(t, "lru-prefetch", profile=replace(base, launch_copy_us=3.0))
    assert [sp for sp in run.spans if sp[1] >= 1 and sp[4] in ("expert", "attention")] == [
        ("sim", 1, 0, "compute", "attention", -1, 24, 34, 0), ("sim", 1, 0, "compute", "expert", 0, 37, 39, 1000),
        ("sim", 1, 1, "compute", "attention", -1, 39, 49, 0), ("sim", 1, 1, "compute", "expert", 1, 54, 56, 1000),
        ("sim", 2, 0, "compute", "attention", -1, 56, 66, 0), ("sim", 2, 0, "compute", "expert", 1, 86, 88, 1000),
        ("sim", 2, 1, "compute", "attention", -1, 88, 98, 0), ("sim", 2, 1, "compute", "expert", 0, 106, 108, 1000)]
    plain = run_tiny(t, "lru-prefetch", profile=base)
    assert ("sim", 1, 0, "compute", "expert", 0, 34, 36, 1000) in plain.spans
    assert [sp for sp in plain.spans if sp[1] == 2] == [sp for sp in run.spans if sp[1] == 2]
    # commit's ahead path copies its table inside the route step (`commit_gpu_copy_us` prices that):
    # its layer-0 launch beside the same kind of load (34-54) starts at 34 either way
    ahead = replace(base, commit_ahead=True)
    got = run_tiny(t, "commit", profile=replace(ahead, launch_copy_us=3.0)).spans
    assert ("sim", 1, 0, "compute", "expert", 0, 34, 36, 1000) in got and ("sim", 1, 1, "copy0", "load", 1, 34, 54, 1000) in got
    assert got == run_tiny(t, "commit", profile=ahead).spans


def test_a_queued_pass_starting_beside_a_moving_load_starts_up_start_copy_us_longer():
    """Queued passes (`pass_overlap`), three experts in two slots, 50 us copies on two engines:
    pass 1 prefetches expert 2 for layer 1 (34-84), which it never runs, so the load is still moving
    as passes 2 (48) and 3 start: each start-up, in layer 0's attention span, takes 5 us more (the
    pass's inputs wait behind the load); pass 1, which starts before it, does not."""
    t = tiny_trace([0, 1], [[0, 0]] * 4, [[0, 0], [0, 2], [0, 0], [0, 0]], num_experts=3)
    base = replace(FLAT, h2d_pinned=((1, 0.02),), copy_engines=2, copy_compute_slowdown=0.0, pass_overlap=True)
    got = run_tiny(t, "lru-prefetch", slots=2, profile=replace(base, start_copy_us=5.0))
    assert [sp[6:8] for sp in got.spans if sp[2] == 0 and sp[4] == "attention"] == [(0, 10), (24, 34), (48, 63), (77, 92)]
    assert ("sim", 3, 1, "copy0", "load", 2, 34, 84, 1000) in got.spans
    assert [p[3] for p in got.pass_us] == [24, 24, 29, 29]
    plain = run_tiny(t, "lru-prefetch", slots=2, profile=base)
    assert [sp[6:8] for sp in plain.spans if sp[2] == 0 and sp[4] == "attention"] == [(0, 10), (24, 34), (48, 58), (72, 82)]


def test_static_runs_misses_on_the_cpu():
    run = run_tiny(tiny_trace([0], [[0], [0], [1]], [[0], [0], [1]]), "static")
    # the hidden states go to the host (half the round trip), the expert runs there, the result comes back
    assert run.spans[-5:] == [
        ("sim", 2, 0, "compute", "attention", -1, 24, 34, 0), ("sim", 2, 0, "compute", "route", -1, 34, 36.5, 0),
        ("sim", 2, 0, "cpu", "roundtrip", -1, 34, 36.5, 0), ("sim", 2, 0, "cpu", "cpu_expert", 1, 36.5, 46.5, 1000),
        ("sim", 2, 0, "cpu", "roundtrip", -1, 46.5, 49, 0)]
    assert run.fallbacks == 1 and run.loads == 0 and run.pass_us[-1][3] == 25


# the same link and GPU with an eager host: 30 us to issue a layer's attention, 5 us per expert
HOSTED = replace(FLAT, host_layer_us=30.0, host_sync_us=1.0, host_route_us=2.0, host_expert_us=5.0, copy_fifo=True)


def test_a_slow_host_sets_the_pace_and_hides_a_short_stall():
    t = tiny_trace([0], [[0], [1], [0]], [[0], [1], [0]])
    M = 1
    layout = PoolLayout((1024,), (1,), 1024)
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4, 4]] * M, expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=(0,))
    run = Simulation(make_policy("ondemand", layout, 2, popularity(t)), HOSTED, costs, make_passes(t, 1)).simulate()
    # attention: the host's 30 us, not the GPU's 10; the read-back and planning 3 us; an expert's
    # span is its 5 us of issuing (the kernel needs 2); pass 1's 1 us load lands while the host issues
    assert run.spans[:4] == [
        ("sim", 0, 0, "compute", "attention", -1, 0, 30, 0), ("sim", 0, 0, "compute", "route", -1, 30, 33, 0),
        ("sim", 0, 0, "compute", "expert", 0, 33, 38, 1000), ("sim", 1, 0, "compute", "attention", -1, 38, 68, 0)]
    assert run.spans[4:8] == [
        ("sim", 1, 0, "compute", "route", -1, 68, 71, 0), ("sim", 1, 0, "copy0", "load", 1, 71, 72, 1000),
        ("sim", 1, 0, "compute", "expert", 1, 72, 76, 1000), ("sim", 2, 0, "compute", "attention", -1, 76, 106, 0)]
    assert [p[3] for p in run.pass_us] == [38, 38, 38] and run.stall_us == 2      # 1 us in passes 1 and 2


def test_while_the_gpu_waits_for_a_load_the_host_runs_ahead():
    t = replace(tiny_trace([0, 1], [[0, 0], [1, 0]], [[0, 0], [1, 0]]), expert_bytes=[[100_000, 100_000], [1000, 1000]])
    layout = PoolLayout((100_000, 1024), (1, 1), 101_024)
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4, 4]] * 2, expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=(0, 1))
    run = Simulation(make_policy("ondemand", layout, 2, popularity(t)), HOSTED, costs, make_passes(t, 1)).simulate()
    second = [s for s in run.spans if s[1] == 1]
    # layer 0 misses: a 100 us load, then a 200 us kernel; the host issued layer 1's attention
    # meanwhile, so on the GPU it takes its own 10 us, not the host's 30
    assert second == [
        ("sim", 1, 0, "compute", "attention", -1, 251, 281, 0), ("sim", 1, 0, "compute", "route", -1, 281, 284, 0),
        ("sim", 1, 0, "copy0", "load", 1, 284, 384, 100_000), ("sim", 1, 0, "compute", "expert", 1, 384, 584, 100_000),
        ("sim", 1, 1, "compute", "attention", -1, 584, 594, 0), ("sim", 1, 1, "compute", "route", -1, 594, 597, 0),
        ("sim", 1, 1, "compute", "expert", 0, 597, 602, 1000)]
    assert [p[3] for p in run.pass_us] == [251, 351] and run.stall_us == 100


def _check_no_overwrite_while_read(log):
    """For every slot, no copy interval overlaps a kernel reading it."""
    by_slot = {}
    for t, what, m, slot, e in log:
        by_slot.setdefault((m, slot), []).append((t, what, e))
    for events in by_slot.values():
        reads, writes = {}, []
        for t, what, e in events:
            if what == "read_start":
                reads.setdefault(e, []).append([t, None])
            elif what == "read_end":
                reads[e][-1][1] = t
            elif what == "load_start":
                writes.append([t, None])
            else:
                writes[-1][1] = t
        for ws, we in writes:
            for intervals in reads.values():
                for rs, re_ in intervals:
                    assert we <= rs or ws >= re_, f"copy [{ws}, {we}] overlaps a read [{rs}, {re_}]"


# a calibrated executor: the host sets the pace, loads run in issue order on one copy stream
EAGER_H200 = replace(H200, copy_fifo=True, host_layer_us=900.0, host_expert_us=150.0, host_expert_tail_us=10.0,
                     host_route_us=100.0, host_sync_us=80.0, predict_layer_us=150.0, host_head_us=400.0)


@pytest.mark.parametrize("profile", [H200, EAGER_H200], ids=["h200", "eager-fifo"])
@pytest.mark.parametrize("policy", ["ondemand", "lru-prefetch", "lfu-fallback", "commit", "oracle"])
@pytest.mark.parametrize("batch", [1, 8])
def test_pool_bounds_and_no_slot_overwritten_while_read(policy, batch, profile):
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=8, prompt_len=8, decode_len=24))
    cfg = SimConfig(policy=policy, pool_gb=16, batch=batch)
    from cmoe.sim.run import layout_for
    layout, budget = layout_for(t, cfg)
    passes = make_passes(t, batch)
    p = make_policy(policy, layout, 8, popularity(t), [q.needed for q in passes])
    from cmoe.sim.engine import costs_for
    sim = Simulation(p, profile, costs_for(t, t.spec, t.recipe), passes, record_log=True)
    run = sim.simulate()
    assert layout.used_bytes <= budget["expert_bytes"]
    assert max(run.occupancy) <= layout.total_slots
    assert all(len(w) <= n for w, n in zip(p.pool.where, layout.slots))
    _check_no_overwrite_while_read(run.log)
    # every span is well formed and streams never run two ops at once
    for stream in ("compute", "copy0"):
        s = sorted((a[6], a[7]) for a in run.spans if a[3] == stream)
        assert all(b0 >= a1 - 1e-9 for (_, a1), (b0, _) in zip(s, s[1:]))


def test_padded_slots_fit_at_least_as_many_experts_as_unpadded():
    """A realistic mixed-precision block (a quarter of the experts at 3 bits): padding wastes 6%
    of a slot on those, fragmentation costs the unpadded allocator more."""
    from cmoe.policy.budget import expert_budget
    from cmoe.policy.pool import plan_layout, residency_comparison
    t = generate(preset("mixtral-8x7b"), recipe("w4g128+w3g128:0.25"), SyntheticParams(requests=2, decode_len=120))
    for pool in (16, 20):
        b = expert_budget(t.spec, t.recipe, pool * 10**9, 1, 200)
        lay = plan_layout(t.slot_bytes, 8, b["expert_bytes"], 2)
        cmp = residency_comparison([[list(n) for n in p.needed] for p in make_passes(t, 1, False)], t.expert_bytes, lay)
        assert cmp["padded"]["mean_resident"] >= cmp["unpadded"]["mean_resident"]


def test_same_inputs_give_byte_identical_outputs(tmp_path):
    from cmoe.sim.api import write_outputs
    t = generate(preset("olmoe-1b-7b"), recipe("w4a16"), SyntheticParams(requests=2, decode_len=16))
    for d in ("a", "b"):
        res = [simulate(t, H200, SimConfig(policy=p, pool_gb=3)) for p in ("commit", "lru-prefetch")]
        write_outputs(tmp_path / d, t, H200, res)
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_bad_sizes_give_one_line():
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, decode_len=4))
    with pytest.raises(CmoeError, match="cannot hold mixtral-8x7b's resident weights"):
        simulate(t, H200, SimConfig(pool_gb=1.5))
    with pytest.raises(CmoeError, match="every MoE layer needs at least 2 slots"):
        simulate(t, H200, SimConfig(pool_gb=6))
    with pytest.raises(CmoeError, match="absurd"):
        simulate(t, H200, SimConfig(pool_gb=-3))
    with pytest.raises(CmoeError, match="does not fit the rtx4090"):
        simulate(t, RTX4090, SimConfig(pool_gb=40))
    with pytest.raises(CmoeError, match="batch 8 needs at least 8"):
        simulate(t, H200, SimConfig(pool_gb=20, batch=8))
    bad = HardwareProfile.from_dict({**H200.to_dict(), "expert_gbps": [["bf16", 100.0]]})
    with pytest.raises(CmoeError, match="no expert kernel speed for int4"):
        simulate(t, bad, SimConfig(pool_gb=20))
    with pytest.raises(CmoeError, match="must be positive"):
        HardwareProfile.from_dict({**H200.to_dict(), "hbm_gbps": -1})


def test_transfer_curve_matches_the_measured_h200_points():
    assert H200.h2d_us(64 * 2**20) == pytest.approx(64 * 2**20 / 55.2e3)
    assert H200.h2d_us(2**20) == pytest.approx(2**20 / 34.6e3)
    assert 1.6e3 < H200.h2d_us(93_585_408) < 1.75e3              # one W4A16 Mixtral expert: about 1.7 ms
    assert H200.h2d_us(2**21) == pytest.approx(2**21 / ((34.6 + 49.9) / 2 * 1e3))


def test_where_the_host_copies_itself_a_load_costs_host_time():
    """The executor on a CPU copies on its own thread: the 1 us load lengthens the route phase."""
    t = tiny_trace([0], [[0], [1], [0]], [[0], [1], [0]])
    layout = PoolLayout((1024,), (1,), 1024)
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4, 4]], expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=(0,))
    prof = replace(HOSTED, copy_on_host=True)
    run = Simulation(make_policy("ondemand", layout, 2, popularity(t)), prof, costs, make_passes(t, 1)).simulate()
    assert ("sim", 1, 0, "compute", "route", -1, 68, 72, 0) in run.spans
    assert [p[3] for p in run.pass_us] == [38, 39, 39]


def test_a_slot_reused_within_a_layer_is_loaded_behind_its_first_kernel():
    """Two requests need experts 0 and 1 of a block with one slot: in issue order (one copy
    stream) expert 1's load is issued right after expert 0's kernel and copies once it has read."""
    base = tiny_trace([0], [[0]], [[0]])
    t = replace(base, experts=np.array([[[0]], [[1]]], np.int16), weights=np.ones((2, 1, 1), np.float32),
                pred_experts=np.array([[[0]], [[1]]], np.int16), request=np.array([0, 1], np.int32),
                step=np.zeros(2, np.int32), phase=np.full(2, DECODE, np.uint8))
    layout = PoolLayout((1024,), (1,), 1024)
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4, 4]], expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=(0,))
    sim = Simulation(make_policy("ondemand", layout, 2, popularity(t)), HOSTED, costs, make_passes(t, 2),
                     record_log=True)
    run = sim.simulate()
    assert run.spans == [
        ("sim", 0, 0, "compute", "attention", -1, 0, 30, 0), ("sim", 0, 0, "compute", "route", -1, 30, 33, 0),
        ("sim", 0, 0, "compute", "expert", 0, 33, 38, 1000), ("sim", 0, 0, "copy0", "load", 1, 38, 39, 1000),
        ("sim", 0, 0, "compute", "expert", 1, 39, 43, 1000)]
    assert run.pass_us[0][3] == 43 and run.loads == 1
    _check_no_overwrite_while_read(run.log)


def test_dense_layers_do_not_change_how_many_rows_an_expert_runs_on():
    """Up to `dense_rows` rows every expert runs on all of the pass's rows, also in a model whose
    first decoder layer is dense: two requests, one expert each, 1 us of issuing per extra row."""
    base = tiny_trace([0], [[0]], [[0]])
    spec = replace(base.spec, num_layers=2, moe_layers=(1,), dense_ffn=4)
    t = replace(base, spec=spec, experts=np.array([[[0]], [[1]]], np.int16), weights=np.ones((2, 1, 1), np.float32),
                pred_experts=np.array([[[0]], [[1]]], np.int16), request=np.array([0, 1], np.int32),
                step=np.zeros(2, np.int32), phase=np.full(2, DECODE, np.uint8))
    layout = PoolLayout((1024,), (2,), 2048)
    costs = Costs(expert_bytes=t.expert_bytes, expert_bits=[[4, 4]], expert_params=0, attn_bytes=0,
                  dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=(1,))
    prof = replace(HOSTED, dense_rows=16, host_expert_us_per_token=1.0)
    run = Simulation(make_policy("upper", layout, 2, popularity(t)), prof, costs, make_passes(t, 2)).simulate()
    experts = [s for s in run.spans if s[4] == "expert"]
    assert [s[7] - s[6] for s in experts] == [6, 6]          # 5 us + 1 us for the second row, each
