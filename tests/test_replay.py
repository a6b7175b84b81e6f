"""The compiled replay against the SimPy model of record: identical spans, per-pass figures,
occupancy, slot logs and metrics (compared with ==), on every policy, several models, batch > 1
and profiles that exercise every mechanism (priority and FIFO copy queues, one and two copy
engines, host copies, slow hosts, CPU fallbacks, the copy/compute slowdown, integer times whose
ties SimPy breaks by event order); the compiled policy twins against the Python classes; the
vectorised passes against the old per-pass code; memory without timelines."""

from dataclasses import replace

import numpy as np
import pytest

from cmoe.core.hw import H200, HardwareProfile
from cmoe.policy.policies import POLICIES, OnDemand, make_policy
from cmoe.policy.pool import PoolLayout
from cmoe.core.quant import recipe
from cmoe.sim.engine import Costs, Simulation, costs_for
from cmoe.sim.replay import Replay
from cmoe.sim.run import SimConfig, layout_for, simulate
from cmoe.core.spec import ModelSpec, preset
from cmoe.trace.bundle import DECODE, PREFILL, Trace
from cmoe.trace.pass_arrays import Future, build, to_passes
from cmoe.trace.passes import make_passes, popularity, ranked
from cmoe.trace.synthetic import SyntheticParams, generate

EAGER = replace(H200, copy_fifo=True, host_layer_us=900.0, host_expert_us=150.0, host_expert_tail_us=10.0,
                host_route_us=100.0, host_sync_us=80.0, predict_layer_us=150.0, host_head_us=400.0,
                host_load_us=7.0, commit_route_us=30.0, head_us=50.0, pass_start_us=20.0)
TWO_ENGINES = replace(H200, copy_engines=2, dense_rows=4, cpu_expert_us_per_token=3.0, readback_copy_us=9.0,
                      cpu_lead_us=70.0, cpu_gap_us=25.0, cpu_tail_us=50.0,
                      cpu_wake_points=((50.0, 0.0), (600.0, 200.0), (3000.0, 500.0)),
                      roundtrip_points=((1, 80.0), (8, 130.0)))
CPU_TABLE = replace(TWO_ENGINES, name="cpu-table", cpu_expert_points=((1, 1.0), (2, 1.3), (4, 1.9), (5, 2.8)))
ON_HOST = replace(EAGER, copy_on_host=True, copy_engines=2, host_expert_us_per_token=4.0, host_attn_us_per_token=2.0)
# integer times everywhere: copies and kernels end on the same instants, SimPy's event order decides
FLAT = HardwareProfile(name="flat", gpu_mem_bytes=10**12, h2d_pinned=((1, 1.0),), d2h_pinned=((1, 1.0),),
                       h2d_pageable_gbps=1.0, copy_engines=1, hbm_gbps=1e12, matmul_tflops=1e12,
                       expert_gbps=(("int4", 0.5), ("int8", 0.5), ("bf16", 0.5)), launch_us=0.0,
                       layer_fixed_us=10.0, attn_us_per_token=0.0, cpu_expert_gbps=0.1, roundtrip_us=4.0,
                       copy_compute_slowdown=0.5)
FLAT2 = replace(FLAT, copy_engines=2, host_layer_us=3.0, host_expert_us=1.0, host_sync_us=1.0)
FLAT_FIFO = replace(FLAT, copy_fifo=True, host_layer_us=12.0, host_expert_us=2.0, host_route_us=1.0)
# the lean executor: fused launches (waves), a silent upper, commit ahead of its read-back
LEAN = replace(EAGER, silent_upper=True, commit_ahead=True, wave_gbps=3000.0, wave_us=25.0, wave_row_us=0.5,
               host_expert_us=40.0, h2d_queued_us=8.0, copy_attention_slowdown=0.12, readback_copy_us=11.0)
FLAT_WAVE = replace(FLAT_FIFO, wave_gbps=0.5, wave_us=1.0, wave_row_us=1.0, commit_ahead=True)
# ... whose copies queued behind another skip the start-up: 1000 bytes in 0.75 us instead of 1, 2000 in 1.25
# instead of 4 / 3 (`h2d_queued`)
FLAT_QUEUE = replace(FLAT_WAVE, h2d_pinned=((1000, 1.0), (4000, 2.0)), h2d_queued_us=0.25)
# the lean executor's graphed decode passes queued back to back, its host a little slower than the GPU
QUEUED = replace(LEAN, pass_overlap=True, host_layer_us=300.0, host_pass_start_us=250.0, pass_gap_us=120.0,
                 launch_copy_us=7.0, start_copy_us=20.0, cpu_lead_us=80.0, cpu_gap_us=20.0, cpu_tail_us=45.0, cpu_pass_start_us=480.0,
                 cpu_pass_gap_us=150.0)
# ... whose route step runs slower after a long read-back wait (`host_wake`)
WAKE = replace(QUEUED, host_wake_points=((50.0, 1.0), (400.0, 1.6), (2000.0, 2.4)),
               host_route_waits=((1, 50.0), (2, 120.0), (4, 300.0)))


def same_run(a, b) -> None:
    assert a.pass_us == b.pass_us
    assert a.per_pass == b.per_pass
    assert a.occupancy == b.occupancy
    assert a.spans == b.spans
    assert a.log == b.log


def both(t, policy, profile, batch, pool_gb=None, slots=None, costs=None):
    """(SimPy run, replay run, the two policy objects) on the same passes and layout."""
    cfg = SimConfig(policy=policy, pool_gb=pool_gb or 20, batch=batch, slots=slots)
    layout = layout_for(t, cfg)[0] if costs is None else PoolLayout((1024,) * t.spec.num_moe_layers,
                                                                    (slots,) * t.spec.num_moe_layers, 0)
    costs = costs or costs_for(t, t.spec, t.recipe)
    passes, pa = make_passes(t, batch), build(t, batch)
    pa_s = make_policy(policy, layout, t.spec.num_experts, popularity(t), [p.needed for p in passes])
    pb = make_policy(policy, layout, t.spec.num_experts, popularity(t), Future(pa))
    a = Simulation(pa_s, profile, costs, passes, record_log=True).simulate()
    b = Replay(pb, profile, costs, pa, record_log=True).simulate()
    return a, b, pa_s, pb


def trace_of(model, requests, decode, seed=0, prompt=6, quant="w4a16"):
    return generate(preset(model), recipe(quant), SyntheticParams(requests=requests, prompt_len=prompt,
                                                                  decode_len=decode, seed=seed))


CASES = [  # model, pool GB, batch, profile
    ("mixtral-8x7b", 20, 1, H200), ("mixtral-8x7b", 16, 4, EAGER), ("mixtral-8x7b", 14, 2, TWO_ENGINES),
    ("deepseek-v2-lite", 6, 1, H200), ("deepseek-v2-lite", 6, 3, ON_HOST), ("qwen1.5-moe-a2.7b", 6, 2, EAGER),
    ("olmoe-1b-7b", 3, 4, TWO_ENGINES), ("mixtral-8x7b", 16, 4, LEAN), ("deepseek-v2-lite", 6, 3, LEAN),
    ("mixtral-8x7b", 16, 1, QUEUED), ("deepseek-v2-lite", 6, 3, QUEUED), ("mixtral-8x7b", 16, 2, WAKE),
    ("mixtral-8x7b", 14, 4, CPU_TABLE),
]


@pytest.mark.parametrize("model,pool,batch,profile", CASES, ids=[f"{m}-b{b}-{p.name}-{i}" for i, (m, _, b, p) in enumerate(CASES)])
@pytest.mark.parametrize("policy", POLICIES)
def test_replay_equals_simpy(model, pool, batch, profile, policy):
    t = trace_of(model, requests=2 * batch, decode=12, seed=batch)
    a, b, pa, pb = both(t, policy, profile, batch, pool)
    same_run(a, b)
    assert [list(w.items()) for w in pa.pool.where] == [list(w.items()) for w in pb.pool.where]
    assert pa.pool.free == pb.pool.free and pa.freq == pb.freq


def tiny(M, E, T, seed, requests=1, K=1):
    """Random hand-sized traces on the FLAT profiles: 1000-byte experts copy in 1 us, run in 2."""
    rng = np.random.default_rng(seed)
    spec = ModelSpec(name="tiny", family="mixtral", num_layers=M, hidden=4, expert_ffn=4, num_experts=E, top_k=K,
                     num_heads=1, num_kv_heads=1, head_dim=4, vocab=8, moe_layers=tuple(range(M)))
    ex = np.stack([rng.permutation(E)[:K] for _ in range(T * M)]).reshape(T, M, K).astype(np.int16)
    pred = np.where(rng.random((T, M, K)) < 0.7, ex, rng.integers(0, E, (T, M, K))).astype(np.int16)
    req = np.repeat(np.arange(requests, dtype=np.int32), T // requests)
    step = np.tile(np.arange(T // requests, dtype=np.int32), requests)
    return Trace(experts=ex, weights=np.ones((T, M, K), np.float32), pred_experts=pred, request=req, step=step,
                 phase=np.where(step < 2, PREFILL, DECODE).astype(np.uint8), spec=spec, recipe=recipe("w4a16"),
                 expert_bytes=[[1000 * (1 + (e % 3 == 0)) for e in range(E)] for _ in range(M)])


def tiny_costs(t):
    M = t.spec.num_moe_layers
    return Costs(expert_bytes=t.expert_bytes, expert_bits=[[4] * t.spec.num_experts] * M, expert_params=0,
                 attn_bytes=0, dense_bytes=0, shared_bytes=0, dense_bits=16, moe_layers=t.spec.moe_layers)


# copies four times as long, an attention side that a copy slows by a quarter and experts by a half,
# and a read-back half a microsecond later beside a load
FLAT_SLOW = replace(FLAT_FIFO, h2d_pinned=((1, 0.25),), copy_attention_slowdown=0.25, readback_copy_us=0.5)
# ... and in fused launches, each issued beside a moving load a quarter of a microsecond later
FLAT_TABLE = replace(FLAT_WAVE, h2d_pinned=((1, 0.25),), readback_copy_us=0.5, launch_copy_us=0.25)
# ... and a fused launch beside a moving load 0.75 us more plus the factor on its own experts' part, not
# on commit's OWA (0.5 us: `wave_beside_copy`)
FLAT_LAUNCH = replace(FLAT_TABLE, copy_launch_us=0.75, owa_gpu_us=0.5)
# ... and passes queued back to back, whose start-up (0.1 us) beside a moving load takes 0.7 us more
# (sums that round, so the engines must add them in one order)
FLAT_START = replace(FLAT_SLOW, pass_overlap=True, start_copy_us=0.7, pass_start_us=0.1)
# ... and a CPU-expert policy's own pass start, whose GPU start-up waits for its host (`startup_after_host`),
# with copies slow enough (100 us) that a pass's loads are still moving as the next one starts
FLAT_CPU_START = replace(FLAT_START, h2d_pinned=((1, 0.01),), cpu_pass_start_us=3.0, cpu_lead_us=0.5)
# ... and a host pass start of 0.3 us, 0-3.3 us longer after a 20-90 us decode pass
# (`pass_start_extra_us`; sums that round, so the engines must add them in one order)
FLAT_PASS_WAKE = replace(FLAT_START, host_pass_start_us=0.3, host_pass_start_points=((20.0, 0.0), (90.0, 3.3)))
# ... and 0-2.7 us more after a pass whose last read-back waited 0.5-4 us (`boundary_extra_us`)
FLAT_BOUNDARY = replace(FLAT_PASS_WAKE, host_boundary_points=((0.5, 0.0), (4.0, 2.7)))


@pytest.mark.parametrize("profile", [FLAT, FLAT2, FLAT_FIFO, FLAT_WAVE,
                                     replace(FLAT_WAVE, host_wake_points=((0.0, 1.0), (3.0, 2.5))), FLAT_QUEUE, FLAT_SLOW,
                                     FLAT_TABLE, FLAT_LAUNCH, FLAT_START, FLAT_CPU_START, FLAT_PASS_WAKE, FLAT_BOUNDARY],
                         ids=["flat", "flat-2-engines", "flat-fifo", "flat-waves", "flat-waves-wake", "flat-queue",
                              "flat-slow-copies", "flat-table-copies", "flat-launch-copies",
                              "flat-start-copies", "flat-cpu-start-copies", "flat-pass-wake", "flat-boundary"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_replay_breaks_ties_as_simpy_does(profile, policy, seed):
    t = tiny(M=3, E=4, T=24, seed=seed, requests=2 + seed % 2, K=2)
    batch = 1 + seed % 2
    slots = 4 if policy == "upper" else 2 + (seed == 2)
    a, b, _, _ = both(t, policy, profile, batch, slots=slots, costs=tiny_costs(t))
    same_run(a, b)


def test_a_launch_beside_a_load_pays_a_fixed_part_and_the_factor_on_its_own_experts():
    """`copy_launch_us` set: a fused launch that starts beside a moving load takes it more, plus
    `copy_compute_slowdown` on all but commit's OWA (`extra`); without it, the factor on the whole
    launch, as before. The runs it reaches change, and both engines price them alike."""
    assert FLAT_LAUNCH.wave_beside_copy(10.0, 2.0) == 8.0 * 1.5 + 2.0 + 0.75
    assert FLAT_TABLE.wave_beside_copy(10.0, 2.0) == 15.0 and FLAT_TABLE.copy_launch_us is None
    t = tiny(M=3, E=4, T=24, seed=1, requests=2, K=2)
    for policy in ("oracle", "lru-prefetch", "commit"):
        a, b, _, _ = both(t, policy, FLAT_LAUNCH, 2, slots=2, costs=tiny_costs(t))
        c, d, _, _ = both(t, policy, replace(FLAT_LAUNCH, copy_launch_us=None), 2, slots=2, costs=tiny_costs(t))
        same_run(a, b)
        same_run(c, d)
        assert a.pass_us != c.pass_us, policy


def test_the_start_ups_wait_beside_a_load_counts_on_both_of_its_paths():
    """The start-up's wait beside a moving load (`start_copy_us`) changes the runs it should on both
    paths of a pass start, the GPU's start-up launched at once (`oracle`) and after a CPU-expert
    policy's host pass start (`lfu-fallback`), and the engines agree on each with and without it."""
    assert FLAT_CPU_START.startup_after_host(True) and not FLAT_START.startup_after_host(True)
    t = tiny(M=3, E=4, T=24, seed=0, requests=2, K=2)
    for policy, profile in (("oracle", FLAT_START), ("lfu-fallback", FLAT_CPU_START)):
        a, b, _, _ = both(t, policy, profile, 1, slots=2, costs=tiny_costs(t))
        c, d, _, _ = both(t, policy, replace(profile, start_copy_us=0.0), 1, slots=2, costs=tiny_costs(t))
        same_run(a, b)
        same_run(c, d)
        assert a.pass_us != c.pass_us


@pytest.mark.parametrize("seed", range(3))
def test_a_copy_queued_behind_another_pays_no_start_up(seed):
    """Each engine's copy that starts the instant the one before it landed takes `h2d_queued`;
    one that starts after the engine idled (or waited for its slot's reader), the whole curve."""
    assert FLAT_QUEUE.h2d_queued(1000) == 0.75 and FLAT_QUEUE.h2d_queued(2000) == 1.25
    assert replace(FLAT_QUEUE, h2d_queued_us=0.0).h2d_queued(2000) == FLAT_QUEUE.h2d_us(2000)
    assert FLAT_QUEUE.h2d_queued(4000) == FLAT_QUEUE.h2d_us(4000) == 2.0      # never slower than alone
    t = tiny(M=3, E=4, T=24, seed=seed, requests=2, K=2)
    a, b, _, _ = both(t, "ondemand", FLAT_QUEUE, 2, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    loads = sorted((s[6], s[7], s[8]) for s in a.spans if s[4] == "load")
    queued = alone = 0
    for (_, end0, _), (start, end, nbytes) in zip(loads, loads[1:]):
        want = FLAT_QUEUE.h2d_queued(nbytes) if start == end0 else FLAT_QUEUE.h2d_us(nbytes)
        assert end - start == pytest.approx(want, abs=1e-9)
        queued += start == end0
        alone += start != end0
    assert queued > 0 and alone > 0


class MyLru(OnDemand):
    """A policy the replay has no compiled twin for: its own `plan` decides, in Python."""
    name = "my-lru"


def test_a_policy_without_a_twin_decides_in_python():
    t = trace_of("mixtral-8x7b", requests=2, decode=10)
    costs, layout = costs_for(t, t.spec, t.recipe), layout_for(t, SimConfig(policy="ondemand", pool_gb=16))[0]
    passes, pa = make_passes(t, 1), build(t, 1)
    a = Simulation(MyLru(layout, 8, popularity(t)), H200, costs, passes).simulate()
    b = Replay(MyLru(layout, 8, popularity(t)), H200, costs, pa).simulate()
    same_run(a, b)


def test_replay_takes_pass_objects_too():
    t = trace_of("olmoe-1b-7b", requests=2, decode=8)
    costs, layout = costs_for(t, t.spec, t.recipe), layout_for(t, SimConfig(policy="commit", pool_gb=3))[0]
    passes = make_passes(t, 2)
    a = Simulation(make_policy("commit", layout, 64, popularity(t)), EAGER, costs, passes).simulate()
    b = Replay(make_policy("commit", layout, 64, popularity(t)), EAGER, costs, passes).simulate()
    same_run(a, b)


@pytest.mark.parametrize("policy", ["commit", "oracle", "lfu-fallback"])
def test_simulate_gives_the_same_metrics_on_both_engines(policy):
    t = trace_of("deepseek-v2-lite", requests=4, decode=16)
    for batch in (1, 2):
        a = simulate(t, H200, SimConfig(policy=policy, pool_gb=6, batch=batch, engine="simpy"))
        b = simulate(t, H200, SimConfig(policy=policy, pool_gb=6, batch=batch, engine="replay"))
        assert a.metrics == b.metrics and a.run.spans == b.run.spans


def test_without_a_timeline_no_span_is_kept_and_the_metrics_are_the_same():
    t = trace_of("mixtral-8x7b", requests=2, decode=16)
    a = simulate(t, H200, SimConfig(policy="lru-prefetch", pool_gb=16))
    b = simulate(t, H200, SimConfig(policy="lru-prefetch", pool_gb=16), timeline=False)
    assert a.metrics == b.metrics and a.run.spans and b.run.spans == []


def test_memory_without_a_timeline_stays_flat_in_trace_length():
    """Extra peak memory per decode token (numpy and Python objects; the compiled code allocates
    nothing), between two lengths past one chunk of decisions: the per-pass figures the metrics
    need (~0.6 KB), not the ~35 KB of spans SimPy keeps per Mixtral token."""
    import tracemalloc
    peaks = []
    for decode in (512, 2048):
        t = trace_of("mixtral-8x7b", requests=2, decode=decode)
        simulate(t, H200, SimConfig(policy="ondemand", pool_gb=16), timeline=False)      # compiled, passes built
        tracemalloc.start()
        simulate(t, H200, SimConfig(policy="ondemand", pool_gb=16), timeline=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    per_token = (peaks[1] - peaks[0]) / (2 * (2048 - 512))
    assert per_token < 1500, per_token


def test_an_unknown_engine_is_one_line():
    from cmoe.core.errors import CmoeError
    t = trace_of("mixtral-8x7b", requests=1, decode=2)
    with pytest.raises(CmoeError, match="unknown engine 'fast': choose replay"):
        simulate(t, H200, SimConfig(engine="fast"))


# passes ------------------------------------------------------------------------------------------
def old_make_passes(t, batch, include_prefill=True, groups=None, decode_steps=None):
    """The per-pass code make_passes had before it was vectorised, the reference."""
    reqs = np.unique(t.request)
    M = t.spec.num_moe_layers
    experts, pred = t.experts.tolist(), t.pred_experts.tolist()
    out = []
    for g in list(range(0, reqs.size - batch + 1, batch))[:groups]:
        in_group = np.isin(t.request, reqs[g:g + batch])
        todo = []
        if include_prefill:
            pre = np.nonzero(in_group & (t.phase == PREFILL))[0]
            if pre.size:
                todo.append((False, pre))
        dec = np.nonzero(in_group & (t.phase == DECODE))[0]
        order = np.lexsort((t.request[dec], t.step[dec]))
        dec, steps = dec[order], t.step[dec[order]]
        for s in np.unique(steps)[:decode_steps]:
            todo.append((True, dec[steps == s]))
        for decode, idx in todo:
            rows = idx.tolist()
            need = [ranked([experts[i][m] for i in rows]) for m in range(M)]
            guess = [ranked([pred[i][m] for i in rows])[0] for m in range(M)]
            out.append((len(out), decode, idx.tolist(), tuple(r[0] for r in need), tuple(guess),
                        tuple(r[1] for r in need), int(t.step[idx].astype(np.int64).sum()) + len(rows)))
    return out


def as_tuples(passes):
    return [(p.index, p.decode, p.tokens.tolist(), p.needed, p.predicted, p.votes, p.context) for p in passes]


def messy_trace(seed):
    """Requests out of order, shuffled tokens, -1 (no expert) and repeated experts in a row."""
    t = trace_of("deepseek-v2-lite", requests=7, decode=5, seed=seed, prompt=3)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(t.num_tokens)
    ex = t.experts[perm].copy()
    ex[rng.random(ex.shape) < 0.1] = -1
    ex[:, :, 2] = np.where(rng.random(ex.shape[:2]) < 0.2, ex[:, :, 0], ex[:, :, 2])
    return replace(t, experts=ex, pred_experts=t.pred_experts[perm], pred_ahead=t.pred_ahead[perm],
                   request=(t.request[perm] * 3) % 7,
                   step=t.step[perm], phase=t.phase[perm], weights=t.weights[perm])


@pytest.mark.parametrize("seed", range(3))
def test_vectorised_passes_equal_the_per_pass_code(seed, monkeypatch):
    import cmoe.trace.pass_arrays as pass_arrays
    monkeypatch.setattr(pass_arrays, "BLOCK_TOKENS", [4096, 5, 1][seed])          # passes ranked in blocks
    t = messy_trace(seed)
    for batch in (1, 2, 3):
        for kw in ({}, {"include_prefill": False}, {"groups": 1}, {"decode_steps": 2}, {"groups": 2, "decode_steps": 0},
                   {"decode_steps": -1}, {"groups": -1}):
            assert as_tuples(make_passes(t, batch, **kw)) == old_make_passes(t, batch, **kw), (batch, kw)
            assert as_tuples(to_passes(build(t, batch, **kw))) == old_make_passes(t, batch, **kw)
        check_ahead(t, build(t, batch))


def check_ahead(t, pa):
    """Each distance's predictions are ranked as distance 1's are, and `seen` reads them back."""
    M, D = t.spec.num_moe_layers, t.depth
    ps = to_passes(pa)
    assert pa.depth == D == 4
    for p, ps_ in enumerate(ps):
        rows = pa.tok[pa.tok_ptr[p]:pa.tok_ptr[p + 1]].tolist()
        for m in range(M):
            want = [ranked([t.pred_ahead[i, m, k].tolist() for i in rows])[0] for k in range(D)]
            assert ps_.ahead[m] == tuple(want) and ps_.ahead[m][0] == ps_.predicted[m]
        for m in range(M + 1):
            assert ps_.seen(m, 3) == pa.seen(p, m, 3) == [list(ps_.ahead[m + k][k]) for k in range(min(3, M - m))]


def test_every_configuration_runs_one_compiled_version():
    """The arrays handed to the compiled code have one type whatever the model, policy, batch or
    timeline: a second version would be a second compile (~30 s) on a user's first run."""
    from cmoe.sim.replay import clock, compute, decide
    for model, pool in (("deepseek-v2-lite", 6), ("mixtral-8x7b", 20)):
        t = trace_of(model, requests=2, decode=3)
        for policy, batch, timeline in (("commit", 2, True), ("oracle", 1, False), ("upper", 1, True)):
            simulate(t, EAGER if batch == 2 else H200, SimConfig(policy=policy, pool_gb=pool, batch=batch), timeline=timeline)
    for f in (decide.decide, compute.run, clock.start, clock.finish):
        assert len(f.signatures) == 1, (f.__name__, f.signatures)


def test_silent_upper_skips_the_host_step_in_both_engines():
    """A profile of the lean executor (`silent_upper`): upper pays no read-back wait, planning or
    per-expert issue, in SimPy and in the replay alike (to the bit); the other policies still do."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=12))
    silent = replace(EAGER, silent_upper=True)
    a, b, _, _ = both(t, "upper", silent, 1)
    same_run(a, b)
    loud, _, _, _ = both(t, "upper", EAGER, 1)
    dec = [us for _, d, _, us in a.pass_us if d]
    assert sum(dec) < sum(us for _, d, _, us in loud.pass_us if d)
    # with the host ahead, the host-side layer cost alone paces nothing: every layer's experts follow
    # its attention with no route span between them
    assert not [s for s in a.spans if s[4] == "route" and s[1] > 0]
    c, d, _, _ = both(t, "ondemand", silent, 1)
    same_run(c, d)
    e, _, _, _ = both(t, "ondemand", EAGER, 1)
    assert c.pass_us == e.pass_us


@pytest.mark.parametrize("profile", [replace(EAGER, commit_ahead=True), replace(FLAT_FIFO, commit_ahead=True),
                                     replace(ON_HOST, commit_ahead=True, copy_fifo=True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_commit_ahead_in_both_engines(profile, batch):
    """The lean executor's commit (`commit_ahead`): experts before the read-back, the next layer's
    loads after it; SimPy and the replay to the bit, late copies included; and it differs from the
    read-back-first order, so the flag is not a no-op."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=3, prompt_len=6, decode_len=16))
    a, b, _, _ = both(t, "commit", profile, batch, pool_gb=12)
    same_run(a, b)
    assert sum(c.late for c in a.per_pass.values()) + sum(c.hits for c in a.per_pass.values()) > 0
    plain, _, _, _ = both(t, "commit", replace(profile, commit_ahead=False), batch, pool_gb=12)
    assert a.spans != plain.spans


def test_fused_waves_by_hand():
    """`wave_gbps`: a layer's experts are one launch of wave_us plus each expert's bytes at
    wave_gbps plus wave_row_us per row, split evenly over its experts' spans (upper: every expert
    resident, so one wave per layer); without it, each expert is its own kernel."""
    t = tiny(M=3, E=4, T=24, seed=1, requests=2, K=2)
    a, b, _, _ = both(t, "upper", FLAT_WAVE, 2, slots=4, costs=tiny_costs(t))
    same_run(a, b)
    passes = make_passes(t, 2)
    for (p, m), spans in _by_layer(a.spans).items():
        votes = dict(zip(passes[p].needed[m], passes[p].votes[m]))
        want = 1.0 + sum(1000 * (1 + (e % 3 == 0)) / 0.5e3 + 1.0 * votes[e] for e in passes[p].needed[m])
        assert spans[-1][7] - spans[0][6] == pytest.approx(want)
        lengths = {round(s[7] - s[6], 9) for s in spans}
        assert len(lengths) == 1 and [s[5] for s in spans] == list(passes[p].needed[m])
    c, _, _, _ = both(t, "upper", replace(FLAT_WAVE, wave_gbps=0.0), 2, slots=4, costs=tiny_costs(t))
    assert c.spans != a.spans
    # `wave_count_us`: the launch's own cost by its expert count, read from the table, in place of wave_us
    counted = replace(FLAT_WAVE, wave_count_us=((1, 3.0), (2, 5.0), (4, 9.0)))
    a, b, _, _ = both(t, "upper", counted, 2, slots=4, costs=tiny_costs(t))
    same_run(a, b)
    seen = set()
    for (p, m), spans in _by_layer(a.spans).items():
        votes = dict(zip(passes[p].needed[m], passes[p].votes[m]))
        n = len(passes[p].needed[m])
        seen.add(n)
        fixed = {1: 3.0, 2: 5.0, 3: 7.0, 4: 9.0}[n]
        want = fixed + sum(1000 * (1 + (e % 3 == 0)) / 0.5e3 + 1.0 * votes[e] for e in passes[p].needed[m])
        assert spans[-1][7] - spans[0][6] == pytest.approx(want)
    assert len(seen) >= 2


def test_a_wave_starts_once_the_host_has_launched_it():
    """The lean executor's layer: after the read-back and routing (the `route` span), the host sets
    the slot table, queues the waits and launches; the GPU idles until then. So a layer with nothing
    to wait for starts its experts host_expert - host_expert_tail_us after its route span ends, in
    both engines; host_expert is read at the pass's tokens."""
    t = tiny(M=3, E=4, T=24, seed=2, requests=1, K=2)
    prof = replace(FLAT_WAVE, host_expert_us=2.0, host_expert_tail_us=0.5)
    a, b, _, _ = both(t, "ondemand", prof, 1, slots=4, costs=tiny_costs(t))
    same_run(a, b)
    gaps = _launch_gaps(a.spans)
    assert len(gaps) > 20 and all(g == pytest.approx(1.5) for g in gaps.values())
    # calibrate measures a launch's host cost per batch (tokens): a table is read at the pass's
    # tokens (1 here), not at the rows of the wave (2: top-2), in both engines
    table = replace(prof, host_expert_points=((1, 2.0), (2, 7.0), (4, 20.0)))
    a, b, _, _ = both(t, "ondemand", table, 1, slots=4, costs=tiny_costs(t))
    same_run(a, b)
    tokens = {ps.index: len(ps.tokens) for ps in make_passes(t, 1)}
    gaps = _launch_gaps(a.spans)
    assert len(gaps) > 20 and {tokens[p] for p, _ in gaps} >= {1, 2}
    assert all(g == pytest.approx(table.host_expert(tokens[p]) - 0.5) for (p, _), g in gaps.items())
    assert [g for (p, _), g in gaps.items() if tokens[p] == 1] == pytest.approx([1.5] * sum(tokens[p] == 1 for p, _ in gaps))


def test_attention_over_the_cache_costs_the_longest_rows_keys():
    """`attn_us_per_cache_key`: a decode layer's attention costs per key of the pass's longest row
    (rows side by side; a prefill per key summed), `attn_us_per_ctx_token` per key summed over
    rows; both engines alike."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=4, prompt_len=10, decode_len=6))
    pa = build(t, 4)
    for ps in make_passes(t, 4):
        assert pa.keys[ps.index] == ps.keys == t.step[ps.tokens].max() + 1
        assert pa.context[ps.index] == ps.context == (t.step[ps.tokens] + 1).sum()
    base = replace(LEAN, attn_us_per_ctx_token=0.0, host_layer_us=1.0)     # the GPU paces the layers
    runs = {}
    for name, prof in (("none", base), ("cache", replace(base, attn_us_per_cache_key=2.0)),
                       ("sum", replace(base, attn_us_per_ctx_token=2.0))):
        a, b, _, _ = both(t, "upper", prof, 4)
        same_run(a, b)
        runs[name] = {(s[1], s[2]): s[7] - s[6] for s in a.spans if s[4] == "attention" and s[2] > 0}
    for (p, d), us in runs["none"].items():
        # a prefill is SDPA over the prompt, not the decode kernel: it pays per key summed
        assert runs["cache"][(p, d)] - us == pytest.approx(2.0 * (pa.keys[p] if pa.decode[p] else pa.context[p]))
        assert runs["sum"][(p, d)] - us == pytest.approx(2.0 * pa.context[p])
    assert not pa.decode.all() and pa.decode.any()


def test_a_wave_sums_its_time_in_the_engines_order_to_the_last_bit():
    """A fused launch's time is its own cost plus its experts' shares, added in that order in both
    engines: the replay used to add the launch's cost last, and floating point does not
    reassociate, so `upper` at batch 4 (prefill of 8 requests, 8 experts a wave) gave spans one
    unit in the last place apart from SimPy's."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=8, prompt_len=64, decode_len=4))
    a, b, _, _ = both(t, "upper", replace(LEAN, host_layer_us=1.0), 4)
    same_run(a, b)


def test_a_decode_layer_pays_for_the_runs_its_cache_is_cut_into():
    """`attn_us_per_split_run`: the lean attention cuts each head's keys into runs sized by the
    KV cache, which the executor allocates for the trace (its last step + 1 slots): every decode
    layer pays that many runs past the first (a prefill, SDPA, none); both engines alike. Prompt 10
    and 190 decode steps: a 200-slot cache, 4 runs of 64 keys."""
    from cmoe.sim.costs import costs_for
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=10, decode_len=190))
    assert costs_for(t, t.spec, t.recipe).cache_len == 200
    base = replace(LEAN, host_layer_us=1.0)
    split = replace(base, attn_us_per_split_run=1.5, attn_split_max=16, attn_split_block=64)
    assert split.attn_split_us(200) == pytest.approx(4.5)
    pa = build(t, 1)
    runs = []
    for prof in (base, split):
        a, b, _, _ = both(t, "upper", prof, 1)
        same_run(a, b)
        runs.append({(s[1], s[2]): s[7] - s[6] for s in a.spans if s[4] == "attention" and s[2] > 0})
    assert runs[0].keys() == runs[1].keys() and any(not pa.decode[p] for p, _ in runs[0])
    for (p, d), us in runs[0].items():
        assert runs[1][(p, d)] - us == pytest.approx(4.5 if pa.decode[p] else 0.0)


def test_the_read_back_and_the_prediction_cost_the_gpu_in_attention():
    """`readback_gpu_us` (every policy but a silent upper) and `predict_gpu_us` (policies that
    predict) lengthen each MoE layer's attention on the GPU; both engines alike."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=6))
    base = replace(LEAN, host_layer_us=1.0, pass_start_us=0.0)
    extra = replace(base, readback_gpu_us=3.0, predict_gpu_us=12.0)
    want = {"upper": 0.0, "ondemand": 3.0, "lru-prefetch": 15.0, "commit": 15.0}
    for policy, delta in want.items():
        runs = []
        for prof in (base, extra):
            a, b, _, _ = both(t, policy, prof, 1, pool_gb=40)
            same_run(a, b)
            runs.append({(s[1], s[2]): s[7] - s[6] for s in a.spans if s[4] == "attention" and s[1] > 0 and s[2] > 0})
        assert runs[0].keys() == runs[1].keys() and runs[0]
        assert all(runs[1][k] - runs[0][k] == pytest.approx(delta) for k in runs[0]), policy


def _launch_gaps(spans) -> dict:
    """(pass, layer) -> the idle from a layer's route span to its first expert, for the layers
    that load nothing themselves."""
    routes = {(s[1], s[2]): s[7] for s in spans if s[4] == "route"}
    loads = {(s[1], s[2]) for s in spans if s[4] == "load"}
    return {k: ex[0][6] - routes[k] for k, ex in _by_layer(spans).items() if k in routes and k not in loads}


def _by_layer(spans):
    out: dict = {}
    for s in spans:
        if s[4] == "expert":
            out.setdefault((s[1], s[2]), []).append(s)
    return {k: sorted(v, key=lambda s: s[6]) for k, v in out.items()}


def test_waves_group_as_the_executor_launches():
    from cmoe.policy.waves import waves
    assert waves([3, 1, 5, 2], {}) == [[3, 1, 5, 2]]
    # 5 overwrites 3's slot and 2 overwrites 5's: three launches; 1 waits for nobody
    assert waves([3, 1, 5, 2], {5: 3, 2: 5}) == [[3, 1], [5], [2]]
    assert waves([3, 1], {3: 7}) == [[3, 1]]                 # a victim outside the layer's GPU set
    assert waves([], {}) == []


def test_commit_launches_pay_owa_on_the_device():
    """`owa_gpu_us`: every decode launch of commit's ahead path (OWA on the device) is that much
    longer; prefill launches and upper's are not touched; both engines alike."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=6))
    pa = build(t, 1)

    def launches(policy, owa):
        a, b, _, _ = both(t, policy, replace(LEAN, owa_gpu_us=owa), 1, pool_gb=60)
        same_run(a, b)
        return {k: max(x[7] for x in ex) - ex[0][6] for k, ex in _by_layer(a.spans).items()}
    plain, owa = launches("commit", 0.0), launches("commit", 37.0)
    assert plain.keys() == owa.keys() and any(pa.decode[p] for p, _ in plain)
    for (p, d), us in plain.items():
        assert owa[(p, d)] - us == pytest.approx(37.0 if pa.decode[p] else 0.0), (p, d)
    assert launches("upper", 0.0) == launches("upper", 37.0)


def tiny_deep(seed, E=6, M=5, D=3, T=40):
    """A tiny trace with predictions three layers deep (70% right, else any expert)."""
    t = tiny(M=M, E=E, T=T, seed=seed, requests=2, K=2)
    rng = np.random.default_rng(seed + 10)
    deep = np.where(rng.random((T, M, D, 2)) < 0.7, t.experts[:, :, None], rng.integers(0, E, (T, M, D, 2)))
    deep[:, :, 0] = t.pred_experts
    for k in range(2, D + 1):
        deep[:, : k - 1, k - 1] = -1
    return replace(t, pred_ahead=deep.astype(np.int16))


@pytest.mark.parametrize("profile", [FLAT, FLAT_FIFO, FLAT_WAVE], ids=["flat", "flat-fifo", "flat-waves"])
@pytest.mark.parametrize("policy", ["adaptive-ahead", "commit-ahead"])
@pytest.mark.parametrize("seed", range(3))
def test_look_ahead_twins_decide_as_the_classes(profile, policy, seed):
    """Predictions three deep, four or five slots of six experts (so fetches fill blocks to their
    room and wanted experts crowd the victims): the same spans, loads and end state."""
    t = tiny_deep(seed)
    batch, slots = 1 + seed % 2, 4 + seed % 2
    a, b, pa, pb = both(t, policy, profile, batch, slots=slots, costs=tiny_costs(t))
    same_run(a, b)
    assert (pa.wanted, pa.fresh, pa.named) == (pb.wanted, pb.fresh, pb.named)
    assert [list(w.items()) for w in pa.pool.where] == [list(w.items()) for w in pb.pool.where]
    kinds = load_kinds(make_policy(policy, pa.layout, 6, popularity(t)), make_passes(t, batch))
    assert kinds["prefetch"] > 0 and kinds["demand" if policy == "adaptive-ahead" else "commit"] > 0, kinds


def load_kinds(pol, passes) -> dict[str, int]:
    """The loads a policy object makes over passes, by kind (driven as the engines drive it)."""
    kinds = {"demand": 0, "prefetch": 0, "commit": 0}
    M = len(pol.layout.slots)
    for ps in passes:
        lds = pol.begin_pass(ps.decode, list(ps.predicted[0]), ahead=ps.seen(0, pol.depth))
        for m in range(M):
            nxt = list(ps.predicted[m + 1]) if m + 1 < M else None
            lds += pol.plan(m, list(ps.needed[m]), nxt, ahead=ps.seen(m + 1, pol.depth)).loads
        for ld in lds:
            kinds[ld.kind] += 1
    return kinds


def test_look_ahead_policies_pay_for_every_early_router():
    """The executor runs the routers of layers q .. q+depth-1 on the state that predicts layer q,
    for q = 0 (a pass's start) to M-1 (`routes._deep`): both engines charge that many predictions
    a pass, spread evenly over its M layers."""
    from cmoe.sim.costs import routers
    layout = PoolLayout((1,) * 8, (4,) * 8, 0)
    pol = lambda name: make_policy(name, layout, 8, [[1] * 8] * 8)       # noqa: E731
    executor = sum(len(range(q, min(q + 4, 8))) for q in range(8))          # 4+4+4+4+4+3+2+1 = 26
    assert [routers(pol(p), 8) for p in ("ondemand", "commit", "adaptive-ahead")] == [0.0, 1.0, executor / 8]
    t = trace_of("mixtral-8x7b", requests=1, decode=6)
    a, b, _, _ = both(t, "adaptive-ahead", replace(EAGER, predict_layer_us=150.0, predict_gpu_us=20.0), 1)
    same_run(a, b)
    one = both(t, "adaptive-ahead", replace(EAGER, predict_layer_us=0.0, predict_gpu_us=0.0), 1)[0]
    assert sum(x[3] for x in a.pass_us) > sum(x[3] for x in one.pass_us)


def test_queued_passes_start_where_the_gpu_gets_to_them():
    """`pass_overlap` (the lean executor's graphed decode): with the host ahead, a decode pass that
    follows a decode pass starts on the GPU exactly where the pass before ended (no gap, no sync),
    so each such pass is shorter than a synced one by the host's pass start less the GPU's; the
    first decode pass (capture) and the prefill still sync. Both engines alike, to the bit."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=10))
    fast = replace(LEAN, host_layer_us=5.0, host_head_us=10.0, host_pass_start_us=50.0, pass_start_us=20.0,
                   pass_gap_us=40.0)
    q, qb, _, _ = both(t, "upper", replace(fast, pass_overlap=True), 1)
    s, sb, _, _ = both(t, "upper", fast, 1)
    same_run(q, qb)
    same_run(s, sb)

    def bounds(run):
        first = {p: min(x[6] for x in run.spans if x[1] == p and x[4] == "attention") for p, *_ in run.pass_us}
        head = {p: max(x[7] for x in run.spans if x[1] == p and x[4] == "head") for p, *_ in run.pass_us}
        return first, head
    (qf, qh), (sf, sh) = bounds(q), bounds(s)
    dec = [p for p, d, _, _ in q.pass_us if d]
    for p in dec[1:]:                                   # chained: no gap at all; synced: the host's gap
        assert qf[p] == qh[p - 1]
        assert sf[p] == pytest.approx(sh[p - 1] + 40.0)
    assert qf[dec[0]] == pytest.approx(qh[dec[0] - 1] + 40.0)     # the first decode pass syncs
    qp, sp = dict((p, us) for p, _, _, us in q.pass_us), dict((p, us) for p, _, _, us in s.pass_us)
    for p in dec[1:]:
        assert sp[p] - qp[p] == pytest.approx(50.0 - 20.0)
    assert qp[dec[0]] == pytest.approx(sp[dec[0]])


def test_a_loads_host_cost_comes_before_its_copy():
    """The executor plans a load (its slot, its victim) before it issues the copy, so the copy
    starts `host_load_us` after the host's route step, in both engines: the first load of an
    `ondemand` run moves by exactly the cost, and nothing before it moves (tenth H200 session: a
    layer's first copy started 38.7 us after its attention at batch 1, the model had it at 15.0)."""
    t = trace_of("mixtral-8x7b", 2, 3)
    first = {}
    for cost in (0.0, 50.0):
        prof = replace(FLAT_FIFO, host_load_us=cost)
        a, b, _, _ = both(t, "ondemand", prof, 1, pool_gb=16)
        same_run(a, b)
        from cmoe.core.timeline import END, OP, START
        loads = sorted(s[START] for s in a.spans if s[OP] == "load")
        first[cost] = (loads[0], [s for s in a.spans if s[END] < 13.0])      # what ended before any load
    assert first[0.0][0] == 13.0 and first[50.0][0] == 63.0
    assert first[50.0][1] == first[0.0][1] and first[0.0][1]


def test_a_queued_pass_starts_from_the_hosts_clock_not_a_copys_landing():
    """A queued decode pass begins where the host is, even when the pass before ended waiting on
    a copy: the engine's process waited for that copy to land (to know when the kernel behind it
    starts), but the host had issued the kernel and the LM head long before and gone on. So with
    the host far ahead, the next pass's layer 0 starts on the GPU right after the head, and its
    attention takes the GPU's pass start and layer time alone, not the host's pass start (call 9
    of the sixteenth H200 session: at pool 20, batch 1, `ondemand`'s layer 0 was predicted 78 us
    long, 954 against 876, while its host had finished the pass 1.8 ms before the GPU did)."""
    t = trace_of("mixtral-8x7b", 1, 8)
    prof = replace(LEAN, pass_overlap=True, host_layer_us=5.0, host_head_us=10.0, host_pass_start_us=500.0,
                   pass_start_us=20.0, pass_gap_us=0.0, host_load_us=1.0)
    a, b, _, _ = both(t, "ondemand", prof, 1, pool_gb=14)
    same_run(a, b)
    last = max(x[2] for x in a.spans if x[4] == "attention")
    dec = [p for p, d, _, _ in a.pass_us if d]
    head = {p: max(x[7] for x in a.spans if x[1] == p and x[4] == "head") for p in dec}
    loads = {x[1] for x in a.spans if x[4] == "load" and x[2] == last}
    att = {p: min((x for x in a.spans if x[1] == p and x[4] == "attention" and x[2] == 0), key=lambda x: x[6])
           for p in dec}
    chained = [p for p in dec[1:] if p - 1 in loads]
    assert chained                                     # the case at hand: the pass before ended on a copy
    for p in chained:
        s = att[p]
        assert s[6] == head[p - 1]                     # no gap: the first mark where the GPU got to it
        assert s[7] - s[6] < prof.host_pass_start_us   # and the host's pass start hidden behind the copy


def test_a_cpu_layers_host_costs_around_its_experts():
    """`cpu_lead_us`, `cpu_gap_us`, `cpu_tail_us` in both engines: the first CPU layer's first expert
    starts the lead later, each further one the gap after the one before, and the GPU's next layer
    the tail later than with none of them (a host-bound run: the tail holds the next launch)."""
    t = trace_of("mixtral-8x7b", requests=1, decode=4, seed=3)
    spans = {}
    for name, extra in (("none", {}), ("lead", {"cpu_lead_us": 70.0}), ("gap", {"cpu_gap_us": 25.0}),
                        ("tail", {"cpu_tail_us": 50.0})):
        a, b, *_ = both(t, "static", replace(EAGER, **extra), 1, slots=2)
        same_run(a, b)
        spans[name] = a.spans
    first = lambda s: min((x for x in s if x[4] == "cpu_expert"), key=lambda x: x[6])   # noqa: E731
    f0 = first(spans["none"])
    assert first(spans["lead"])[6] == pytest.approx(f0[6] + 70.0)
    same_layer = lambda s: sorted((x for x in s if x[4] == "cpu_expert" and x[1:3] == f0[1:3]), key=lambda x: x[6])  # noqa: E731
    plain, gapped = same_layer(spans["none"]), same_layer(spans["gap"])
    assert len(plain) >= 2
    assert [y[6] - x[7] for x, y in zip(gapped, gapped[1:])] == pytest.approx([25.0] * (len(plain) - 1))
    attn = lambda s: min(x[6] for x in s if x[4] == "attention" and x[1] == f0[1] and x[2] > f0[2])  # noqa: E731
    assert attn(spans["tail"]) == pytest.approx(attn(spans["none"]) + 50.0)


@pytest.mark.parametrize("engine", ["simpy", "replay"])
def test_a_cpu_expert_after_the_cpu_idled_runs_longer(engine):
    """`cpu_wake_points`: each CPU expert's time is its calibrated one plus the extra at the CPU's
    idle time since the last CPU expert ended (the run's first: past the last point), read
    piecewise-linearly and held flat outside the points."""
    from cmoe.sim.run import SimConfig, simulate
    t = trace_of("mixtral-8x7b", requests=1, decode=6, seed=3)
    prof = replace(EAGER, cpu_wake_points=((50.0, 0.0), (600.0, 200.0), (3000.0, 500.0)), cpu_gap_us=10.0)
    cfg = SimConfig(policy="static", pool_gb=20, batch=1, slots=2, engine=engine)
    plain = [s for s in simulate(t, EAGER, cfg).run.spans if s[4] == "cpu_expert"]
    woken = sorted((s for s in simulate(t, prof, cfg).run.spans if s[4] == "cpu_expert"), key=lambda s: s[6])
    base = {(s[1], s[2], s[5]): s[7] - s[6] for s in plain}
    assert prof.cpu_wake_us(10.0) == 0.0 and prof.cpu_wake_us(325.0) == pytest.approx(100.0)
    assert prof.cpu_wake_us(1e9) == 500.0 and EAGER.cpu_wake_us(1e9) == 0.0
    end, extras = float("-inf"), set()
    for s in woken:
        extra = prof.cpu_wake_us(s[6] - end)
        assert s[7] - s[6] == pytest.approx(base[(s[1], s[2], s[5])] + extra), s
        end = s[7]
        extras.add(round(extra, 6))
    assert woken[0][7] - woken[0][6] == pytest.approx(base[woken[0][1], woken[0][2], woken[0][5]] + 500.0)
    assert len(extras) >= 3                                  # short, mid and long idles


@pytest.mark.parametrize("engine", ["simpy", "replay"])
def test_a_cpu_experts_time_by_tokens_reads_the_table(engine):
    """`cpu_expert_points`: each CPU expert takes its one-token time times the table's factor at its
    tokens (the trace's votes), read piecewise-linearly and past 5 tokens (the prefill's) along the
    last piece, in both engines (no wake table here)."""
    from cmoe.sim.run import SimConfig, simulate
    t = trace_of("mixtral-8x7b", requests=8, decode=6, seed=4)
    prof = replace(EAGER, cpu_expert_points=((1, 1.0), (2, 1.3), (4, 1.9), (5, 2.8)))
    run = simulate(t, prof, SimConfig(policy="static", pool_gb=20, batch=8, slots=2, engine=engine)).run
    passes, moe = make_passes(t, 8), {d: m for m, d in enumerate(preset("mixtral-8x7b").moe_layers)}
    seen = set()
    for s in (s for s in run.spans if s[4] == "cpu_expert"):
        p, m = passes[s[1]], moe[s[2]]
        tok = dict(zip(p.needed[m], p.votes[m]))[s[5]]
        want = prof.cpu_expert_us(s[8], 1) * ({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}.get(tok) or 2.8 + 0.9 * (tok - 5))
        assert s[7] - s[6] == pytest.approx(want), s
        seen.add(tok)
    assert {1, 2, 3} <= seen and max(seen) > 5


def test_a_cpu_expert_policys_pass_start_is_its_own_in_both_engines():
    """`cpu_pass_start_us`: the CPU-expert policies' host pays its own pass start (calibrate reads it
    off its `static` runs), in SimPy and in the replay alike; `upper` and `ondemand` pay
    `host_pass_start_us` as before. static's host holds its GPU back at every pass boundary, so every
    pass grows by the difference (480 - 250 us)."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=12))
    plain = replace(QUEUED, cpu_pass_start_us=0.0)
    for pol in ("upper", "ondemand"):
        a, b, _, _ = both(t, pol, QUEUED, 1, pool_gb=16)
        same_run(a, b)
        assert a.pass_us == both(t, pol, plain, 1, pool_gb=16)[0].pass_us
    a, b, _, _ = both(t, "static", QUEUED, 1, pool_gb=16)
    same_run(a, b)
    before = both(t, "static", plain, 1, pool_gb=16)[0]
    assert [x[3] - y[3] for x, y in zip(a.pass_us, before.pass_us)] == [230.0] * len(a.pass_us)
    # every pass's layer 0 starts past the host's books (150 us), and its span holds the rest of
    # the start-up: 230 - 150 us longer than before in a queued pass, 230 - (150 - 120) in the two
    # synced ones (prefill, first decode), whose first mark was past `pass_gap_us` already
    spans0 = lambda r: [s[7] - s[6] for s in r.spans if s[4] == "attention" and s[2] == 0]  # noqa: E731
    assert [x - y for x, y in zip(spans0(a), spans0(before))] == [200.0, 200.0] + [80.0] * (len(a.pass_us) - 2)


def test_a_cpu_expert_policys_gpu_start_up_waits_for_its_hosts_pass_start():
    """`HardwareProfile.startup_after_host`: a CPU-expert policy's host launches the pass's GPU
    start-up (`pass_start_us`) at the end of its own pass start, so the start-up adds to every pass
    (its GPU was idle, waiting for that host); before, it hid inside the host's 480 us, as it still
    does where no CPU-expert pass start was calibrated (the last two runs: the eager rule, whose host
    may have launched it early). Both engines alike. (Thirty-first session, an H100: each
    validation of the CPU-expert policies (18 rows each, `upper` among them) then had every layer
    within 8% in 12 and 10 rows with its own calibration, against 7 and 6.)"""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=8, decode_len=12))
    fast = replace(QUEUED, host_layer_us=5.0)               # a host that keeps up with the GPU's layers
    assert fast.startup_after_host(True) and not fast.startup_after_host(False)
    assert not replace(fast, cpu_pass_start_us=0.0).startup_after_host(True)
    got = {}
    for ps in (20.0, 0.0):
        a, b, _, _ = both(t, "static", replace(fast, pass_start_us=ps), 1, pool_gb=16)
        same_run(a, b)
        got[ps] = a.pass_us
    assert [x[3] - y[3] for x, y in zip(got[20.0], got[0.0])] == pytest.approx([20.0] * len(got[0.0]))
    eager = {}
    for ps in (20.0, 0.0):                                  # the old rule: hidden in the host's
        a, b, _, _ = both(t, "static", replace(fast, pass_start_us=ps, cpu_pass_start_us=0.0), 1, pool_gb=16)
        same_run(a, b)
        eager[ps] = [x[3] for x in a.pass_us]
    assert eager[20.0] == eager[0.0]
