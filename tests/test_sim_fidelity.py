"""What the lean executor's timeline shows that the simulator had to learn (issue 15): where a
pass's first mark lands, and commit's step between its attention and its launch. Each on a
hand-computed case, SimPy and the compiled replay alike (to the bit), and the calibrate side."""

from dataclasses import replace

import pytest

from cmoe.calibrate.profile_fit import _pass_gap_us
from cmoe.core.quant import recipe
from cmoe.core.spec import preset
from cmoe.trace.synthetic import SyntheticParams, generate
from tests.test_replay import FLAT, LEAN, _by_layer, both, same_run, tiny, tiny_costs
from tests.test_sim import tiny_trace


def _attention_and_passes(prof):
    t = tiny_trace([0], [[0], [1], [0]], [[0], [1], [0]])
    a, b, _, _ = both(t, "upper", prof, 1, slots=2, costs=tiny_costs(t))
    same_run(a, b)
    return [(s[6], s[7]) for s in a.spans if s[4] == "attention"], [p[3] for p in a.pass_us]


def test_the_pass_gap_moves_layer_0s_span_start_not_the_pass():
    """`pass_gap_us`: of the host's 10 us pass start, the first 6 come before the executor's first
    mark (the GPU idles between passes), so layer 0's attention span starts 6 us into the pass
    and runs to the host's 10 plus its own 10; pass times do not move; a gap longer than the pass
    start is held to it."""
    base = replace(FLAT, host_pass_start_us=10.0, pass_start_us=4.0)
    spans, passes = _attention_and_passes(replace(base, pass_gap_us=6.0))
    assert spans == [(6.0, 20.0), (28.0, 42.0), (50.0, 64.0)]
    assert passes == [22.0, 22.0, 22.0]
    spans0, passes0 = _attention_and_passes(base)
    assert spans0 == [(0.0, 20.0), (22.0, 42.0), (44.0, 64.0)] and passes0 == passes
    spans_long, _ = _attention_and_passes(replace(base, pass_gap_us=50.0))
    assert spans_long == [(10.0, 20.0), (32.0, 42.0), (54.0, 64.0)]


def test_calibrate_takes_the_pass_gap_from_upper_s_own_run():
    """The lean engine's pass start comes from upper's own run: the host's side is the GPU's idle
    gap between passes plus layer 0's excess, the GPU's the excess alone; the gap is kept as
    `pass_gap_s`, or (measurements from before) taken as the difference; without the fused
    launches (the eager runs' host start-up is layer 0's own) it is 0."""
    m = {"layer": {"pass_start_s": 146e-6, "host": {"pass_start_s": 259e-6}}, "waves": [[2, 2, 8e-5, 1e8]]}
    assert _pass_gap_us(m) == pytest.approx(113.0)
    m["layer"]["host"]["pass_gap_s"] = 120e-6
    assert _pass_gap_us(m) == pytest.approx(120.0)
    assert _pass_gap_us({"layer": {"pass_start_s": 146e-6, "host": {"pass_start_s": 259e-6}}, "waves": []}) == 0.0


def test_commit_pays_its_copies_between_attention_and_launch():
    """`commit_gpu_us`: on commit's ahead path (decode) the read-back's start and the launch's
    inputs run on the compute stream after the attention: with the GPU pacing (no host cost) and
    every expert resident, each decode layer gets a `route` span of exactly that length right after
    its attention, its launch starts where it ends, and a decode pass is that much longer per MoE
    layer; prefill is not touched; both engines alike, and 0 changes nothing."""
    t = tiny(M=3, E=4, T=24, seed=1, requests=1, K=2)
    prof = replace(FLAT, copy_fifo=True, commit_ahead=True, wave_gbps=0.5, wave_us=1.0, wave_row_us=1.0)
    runs = {}
    for us in (0.0, 7.0):
        a, b, _, _ = both(t, "commit", replace(prof, commit_gpu_us=us), 1, slots=4, costs=tiny_costs(t))
        same_run(a, b)
        runs[us] = a
    plain, paid = runs[0.0], runs[7.0]
    assert not [s for s in plain.spans if s[4] == "route"] and not [s for s in paid.spans if s[4] == "load"]
    decode = {p for p, d, _, _ in paid.pass_us if d}
    routes = {(s[1], s[2]): s for s in paid.spans if s[4] == "route"}
    assert set(routes) == {(p, m) for p in decode for m in range(3)}
    attn = {(s[1], s[2]): s[7] for s in paid.spans if s[4] == "attention"}
    first = {k: v[0][6] for k, v in _by_layer(paid.spans).items()}
    for k, s in routes.items():
        assert (s[6], s[7] - s[6], first[k]) == (attn[k], 7.0, s[7]), k
    assert [us - us0 for (_, _, _, us), (_, _, _, us0) in zip(paid.pass_us, plain.pass_us)] == \
        pytest.approx([21.0 if d else 0.0 for _, d, _, _ in paid.pass_us])
    assert decode and len(decode) < len(paid.pass_us)


def test_calibrate_reads_commits_copies_off_its_route_spans():
    """`route_gpu_s`: the medians of commit's decode `route` spans on the compute stream, apart by
    whether a load was moving as each started, the first MoE layer (the pass's start-up) and
    prefill left out; `commit_gpu_s`: the quiet one of the resident run, and the loading run's
    excess over it."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import commit_gpu_s, route_gpu_s
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 0, 1, "compute", "route", -1, 0.0, 90.0),               # prefill
             Span("gpu", 1, 0, "compute", "route", -1, 0.0, 40.0),               # the first layer
             Span("gpu", 1, 1, "host", "route", -1, 0.0, 70.0),                  # not the stream
             Span("gpu", 2, 2, "copy0", "load", 1, 190.0, 400.0)]
    spans += [Span("gpu", p, d, "compute", "route", -1, t, t + us)
              for p, d, t, us in ((1, 1, 100.0, 15.0), (1, 2, 120.0, 16.0), (2, 1, 150.0, 30.0),
                                  (2, 2, 200.0, 44.0), (2, 3, 250.0, 40.0), (3, 1, 400.0, 14.0))]
    log = SimpleNamespace(spans=spans, pass_us=[(0, False, 1, 0.0), (1, True, 1, 0.0), (2, True, 1, 0.0),
                                                (3, True, 1, 0.0)])
    assert route_gpu_s(log, 0) == (pytest.approx(15.5e-6), pytest.approx(42e-6))
    empty = SimpleNamespace(spans=[], pass_us=[])
    assert route_gpu_s(empty, 0) == (0.0, 0.0)
    assert commit_gpu_s(log, log, 0) == (pytest.approx(15.5e-6), pytest.approx(26.5e-6))
    assert commit_gpu_s(log, empty, 0) == (pytest.approx(15.5e-6), 0.0)


def test_commits_copies_wait_behind_a_moving_load():
    """`commit_gpu_copy_us`: the route step takes that much more when a load is moving as it
    starts (its small copies queue behind the load's on the one H2D engine). Pass 1: layer 0's
    route step (276) comes before the host issues layer 1's 100 us load (276-376), so it keeps its
    3 us; layer 1's (329) finds the load moving: 3 + 4 us; its launch still waits for the copy, so
    the pass does not move. Both engines alike."""
    t = replace(tiny_trace([0, 1], [[0, 0], [0, 1]], [[0, 0], [0, 1]]),
                expert_bytes=[[20_000, 20_000], [100_000, 100_000]])
    prof = replace(FLAT, copy_compute_slowdown=0.0, copy_fifo=True, commit_ahead=True, commit_gpu_us=3.0)
    runs = {}
    for us in (0.0, 4.0):
        a, b, _, _ = both(t, "commit", replace(prof, commit_gpu_copy_us=us), 1, slots=1, costs=tiny_costs(t))
        same_run(a, b)
        runs[us] = a
    for us, a in runs.items():
        second = [(s[2], s[3], s[4], s[6], s[7]) for s in a.spans if s[1] == 1]
        assert second == [(0, "compute", "attention", 266.0, 276.0), (0, "compute", "route", 276.0, 279.0),
                          (1, "copy0", "load", 276.0, 376.0), (0, "compute", "expert", 279.0, 319.0),
                          (1, "compute", "attention", 319.0, 329.0), (1, "compute", "route", 329.0, 332.0 + us),
                          (1, "compute", "expert", 376.0, 576.0)]
        assert [p[3] for p in a.pass_us] == [266.0, 310.0]


@pytest.mark.parametrize("policy", ["upper", "ondemand", "commit", "oracle"])
@pytest.mark.parametrize("batch", [1, 3])
def test_both_engines_agree_with_the_new_fields_on(policy, batch):
    """The three fields on a lean profile where loads are frequent: SimPy and the replay to the bit,
    and commit's spans differ from those without them (this slow host hides them from the passes)."""
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=3, prompt_len=6, decode_len=12))
    prof = replace(LEAN, host_pass_start_us=300.0, pass_start_us=150.0, pass_gap_us=110.0, commit_gpu_us=15.6,
                   commit_gpu_copy_us=26.5)
    a, b, _, _ = both(t, policy, prof, batch, pool_gb=12)
    same_run(a, b)
    if policy == "commit":
        plain, _, _, _ = both(t, policy, replace(prof, commit_gpu_us=0.0, commit_gpu_copy_us=0.0), batch, pool_gb=12)
        assert plain.spans != a.spans


def test_commits_pass_start_plans_layer_0_before_it_runs():
    """`commit_start_us`: at a decode pass's start commit reads layer 0's prediction back (1 us of
    host_sync_us here) and then turns it into a plan and loads (5 us) before layer 0's attention
    can be issued: layer 0's span and every pass grow by 5 us, in both engines; ondemand does not
    read back there and does not move."""
    t = tiny_trace([0, 1], [[0, 0], [0, 1]], [[0, 0], [0, 1]])
    prof = replace(FLAT, copy_compute_slowdown=0.0, copy_fifo=True, commit_ahead=True, host_sync_us=1.0)
    seen = {}
    for policy in ("commit", "ondemand"):
        for us in (0.0, 5.0):
            a, b, _, _ = both(t, policy, replace(prof, commit_start_us=us), 1, slots=1, costs=tiny_costs(t))
            same_run(a, b)
            seen[policy, us] = ([(s[6], s[7]) for s in a.spans if s[4] == "attention" and s[2] == 0],
                                [p[3] for p in a.pass_us])
    assert seen["commit", 0.0] == ([(0.0, 11.0), (25.0, 36.0)], [25.0, 25.0])
    assert seen["commit", 5.0] == ([(0.0, 16.0), (30.0, 46.0)], [30.0, 30.0])
    assert seen["ondemand", 0.0] == seen["ondemand", 5.0]


def test_calibrate_prices_commits_pass_start():
    """`start_excess_s`: layer 0's attention and route over the other layers' mean, the median over
    the decode passes (one stalled pass does not move it); the fit takes host_sync_us off commit's excess over upper's (`commit_start_us`)."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import start_excess_s
    from cmoe.calibrate.profile_fit import fit_profile
    from cmoe.core.hw import H200
    from cmoe.core.timeline import Span
    from tests.test_calibrate import _synthetic

    def one(p, a0, r0):
        return [Span("gpu", p, 0, "compute", "attention", -1, 0.0, a0), Span("gpu", p, 0, "compute", "route", -1, a0, a0 + r0),
                Span("gpu", p, 1, "compute", "attention", -1, 0.0, 70.0), Span("gpu", p, 1, "compute", "route", -1, 70.0, 86.0),
                Span("gpu", p, 2, "compute", "attention", -1, 0.0, 74.0), Span("gpu", p, 2, "compute", "route", -1, 74.0, 88.0),
                Span("gpu", p, 1, "compute", "expert", 3, 90.0, 200.0)]
    log = SimpleNamespace(spans=one(0, 900.0, 0.0) + one(1, 300.0, 60.0) + one(2, 320.0, 50.0) + one(3, 5000.0, 0.0),
                          pass_us=[(0, False, 1, 0.0), (1, True, 1, 0.0), (2, True, 1, 0.0), (3, True, 1, 0.0)])
    assert start_excess_s(log, 0) == pytest.approx(370.0 * 1e-6 - 87e-6)      # the median: pass 3 stalled
    known = replace(H200, host_sync_us=80.0, host_layer_us=950.0, host_route_us=100.0, host_expert_us=170.0)
    m = _synthetic(known)
    assert fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-02").commit_start_us == 0.0
    m["layer"]["commit_start_excess_s"] = 200e-6
    assert fit_profile("fit", m, known.gpu_mem_bytes, "test", "2026-12-02").commit_start_us == pytest.approx(120.0)


def test_copy_slowdowns_read_the_models_own_kernels_beside_a_load():
    """A span counts as beside a load where a load begun before it is still on the link (one begun
    later or ended before does not); an attention span is timed from the host's launch of it where
    that came later; a fused launch (abutting expert pieces) is classed once, by its own start, and
    compared within its expert count; the first layer and prefill are left out; None under five."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import copy_slowdowns, launches_by_size
    from cmoe.core.timeline import Span
    spans = [Span("gpu", 1, 1, "copy0", "load", 2, 0.0, 100.0, 1000), Span("gpu", 1, 1, "copy0", "load", 3, 10.0, 20.0, 1000)]
    for i in range(6):
        spans += [Span("gpu", 1, 1 + i, "compute", "attention", -1, 20.0 + i, 75.0 + i, 0),     # 55 us beside the load
                  Span("gpu", 2, 1 + i, "compute", "attention", -1, 200.0 + i, 250.0 + i, 0),   # 50 us after it
                  # the GPU waited 30 us for the host's launch: 40 us of its own, after the load
                  Span("gpu", 3, 1 + i, "compute", "attention", -1, 300.0, 370.0, 0),
                  Span("gpu", 3, 1 + i, "host", "host_attention", -1, 290.0, 330.0, 0),
                  # two-expert launches: one at 90 beside the load (24 us, its second piece after the
                  # load's end), one at 400 after it (20 us); and one-expert launches, all after it
                  Span("gpu", 1, 1 + i, "compute", "expert", 4, 90.0, 102.0, 0),
                  Span("gpu", 1, 1 + i, "compute", "expert", 5, 102.0, 114.0, 0),
                  Span("gpu", 2, 1 + i, "compute", "expert", 4, 400.0, 410.0, 0),
                  Span("gpu", 2, 1 + i, "compute", "expert", 5, 410.0, 420.0, 0),
                  Span("gpu", 3, 1 + i, "compute", "expert", 4, 500.0, 530.0, 0)]
    spans += [Span("gpu", 1, 0, "compute", "attention", -1, 5.0, 500.0, 0),               # the first layer
              Span("gpu", 0, 1, "compute", "attention", -1, 5.0, 500.0, 0)]               # prefill
    log = SimpleNamespace(spans=spans, pass_us=[(0, False, 1, 0.0), (1, True, 1, 0.0), (2, True, 1, 0.0),
                                                (3, True, 1, 0.0)])
    out = copy_slowdowns(log, 0)
    assert launches_by_size(log, 0) == {2: {True: [24.0] * 6, False: [20.0] * 6}, 1: {True: [], False: [30.0] * 6}}
    assert out["attention"] == pytest.approx(55.0 / 45.0 - 1.0)    # quiet: 50 and 40 us, six each
    assert out["expert"] == pytest.approx(0.2)                     # the two-expert launches; one-expert: no busy
    for i in range(12):            # one-expert launches beside the load (15 us) and after it (10 us): with
        spans += [Span("gpu", 1, 1 + i % 6, "compute", "expert", 6, 60.0 + i, 60.0 + i + 15.0, 0),   # pass 3's
                  Span("gpu", 2, 1 + i % 6, "compute", "expert", 6, 600.0 + 40 * i, 600.0 + 40 * i + 10.0, 0)]
    # six of 30 us, the quiet median is 10: +50% over 30 launches, +20% over the twelve two-expert ones
    assert copy_slowdowns(log, 0)["expert"] == pytest.approx((12 * 0.2 + 30 * 0.5) / 42)
    log.spans = [sp for sp in spans if not (sp[4] == "expert" and sp[1] == 1)]
    assert copy_slowdowns(log, 0)["expert"] is None


def test_readback_copy_compares_routes_within_each_count_of_their_own_loads():
    """The route span holds the host issuing the layer's own loads; busy layers here issue fewer
    (1 against 2: a pooled difference would read 14 - 20 = -6 us), so the figure is taken within
    each count: +4 us with one own load, +6 with two, weighted 12:12 -> 5 us."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import readback_copy_s
    from cmoe.core.timeline import Span
    spans, plans = [Span("gpu", 1, 9, "copy0", "load", 2, 0.0, 1000.0, 1000)], []
    moe = (0, 2, 3)                                     # decoder layers of MoE layers 0, 1, 2
    for i in range(6):
        for p_, t0, n, dur in ((1, 100.0, 1, 14.0), (2, 2000.0, 1, 10.0), (3, 200.0, 2, 26.0), (4, 3000.0, 2, 20.0)):
            spans.append(Span("gpu", p_ * 10 + i, 2, "compute", "route", -1, t0 + i, t0 + i + dur, 0))
            plans.append(SimpleNamespace(pass_index=p_ * 10 + i, layer=1, loads=(0,) * n))
    spans.append(Span("gpu", 10, 0, "compute", "route", -1, 5.0, 905.0, 0))          # the first layer
    plans.append(SimpleNamespace(pass_index=10, layer=-1, loads=(1, 2)))              # the pass's own loads
    steps = sorted({sp[1] for sp in spans})
    log = SimpleNamespace(spans=spans, plans=plans, pass_us=[(q, True, 1, 0.0) for q in steps])
    assert readback_copy_s(log, 0, moe) == pytest.approx(5e-6)
    log.plans = [r for r in plans if r.loads != (0, 0)]                 # two-load layers unplanned: count 1 only
    assert readback_copy_s(log, 0, moe) == pytest.approx(4e-6)
    log.spans = [sp for sp in spans if not (sp[4] == "route" and sp[6] < 1000.0)]   # none busy
    assert readback_copy_s(log, 0, moe) is None
    for i in range(6):             # layers that issued no load: +14 us busy (12 over 26), taken alone
        for p_, t0, dur in ((5, 300.0, 26.0), (6, 4000.0, 12.0)):
            spans.append(Span("gpu", p_ * 10 + i, 2, "compute", "route", -1, t0 + i, t0 + i + dur, 0))
            plans.append(SimpleNamespace(pass_index=p_ * 10 + i, layer=1, loads=()))
    log = SimpleNamespace(spans=spans, plans=plans, pass_us=[(q, True, 1, 0.0) for q in sorted({sp[1] for sp in spans})])
    assert readback_copy_s(log, 0, moe) == pytest.approx(14e-6)


def test_launch_copy_is_the_launch_gap_beside_a_load_over_the_quiet_one():
    """Route end to first expert: 20 us while another layer's load moves, 6 us with the link idle ->
    14 us. Left out, each group large enough to move the busy median to 400 us if it were counted:
    layers that load into themselves (their plan), layers whose own prefetch is still landing at the
    route's end, layers whose own prefetch waits queued behind another load then, and the first
    layer. Too few on a side gives None."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import launch_copy_s
    from cmoe.core.timeline import Span
    moe = (0, 2, 3)                                     # decoder layers of MoE layers 0, 1, 2
    spans = [Span("gpu", 1, 9, "copy0", "load", 2, 0.0, 1000.0, 1000),          # another layer's
             Span("gpu", 40, 2, "copy0", "load", 5, 5000.0, 5900.0, 1000),      # layer 2's own, moving
             Span("gpu", 50, 9, "copy0", "load", 6, 7000.0, 8000.0, 1000),      # another layer's, and
             Span("gpu", 50, 2, "copy0", "load", 7, 8000.0, 8100.0, 1000)]      # layer 2's queued behind it
    plans = []

    def layer(p_, t_end, gap, loads=(), d=2, m=1):
        spans.extend([Span("gpu", p_, d, "compute", "route", -1, t_end - 10.0, t_end, 0),
                      Span("gpu", p_, d, "compute", "expert", 3, t_end + gap, t_end + gap + 30.0, 0),
                      Span("gpu", p_, d, "compute", "expert", 1, t_end + gap + 30.0, t_end + gap + 60.0, 0)])
        plans.append(SimpleNamespace(pass_index=p_, layer=m, loads=loads))
    for i in range(6):
        layer(10 + i, 100.0 + 100 * i, 20.0)                       # busy
        layer(20 + i, 2000.0 + 100 * i, 6.0)                       # quiet
    for i in range(7):
        layer(30 + i, 620.0 + 50 * i, 400.0, loads=((1, 4, 0, -1, 0),))    # loads into itself
        layer(40 + i, 5100.0 + 100 * i, 400.0)                     # its own prefetch still landing
        layer(50 + i, 7100.0 + 100 * i, 400.0 + (8000.0 - 7100.0 - 100 * i))   # its own prefetch queued
        layer(60 + i, 130.0 + 100 * i, 400.0, d=0, m=0)            # the first layer
    log = SimpleNamespace(spans=spans, plans=plans, pass_us=[(q, True, 1, 0.0) for q in sorted({sp[1] for sp in spans})])
    assert launch_copy_s(log, 0, moe) == pytest.approx(14e-6)
    log.spans = [sp for sp in spans if not (sp[4] == "route" and 2000.0 <= sp[7] < 3000.0)]   # no quiet route
    assert launch_copy_s(log, 0, moe) is None


def test_start_copy_is_the_first_layers_excess_beside_a_load_over_the_other_layers():
    """Five passes start beside a load (the first layer's attention 120 us, the next one's, still
    beside it, 66; the third's, after it landed, 57) and five without (94, 57, 57): (120 - 94) -
    (66 - 57) = 17 us. With no quiet pass of its own, a quiet run's (ondemand with every expert
    resident: 90 and 55) stands in: (120 - 90) - (66 - 55) = 19 us. Too few passes on a side, or no
    run to stand in, gives None. The first layer is the model's first MoE layer (a dense decoder
    layer before it runs inside its span): the same spans one layer up, read from layer 1, agree."""
    from types import SimpleNamespace

    from cmoe.calibrate.commit_steps import start_copy_s
    from cmoe.core.timeline import Span

    def run(passes, busy, l0, l1, l2, first=0):
        spans = []
        for p_ in passes:
            t = 1000.0 * p_
            if busy:
                spans.append(Span("gpu", p_, 9, "copy0", "load", 2, t - 10.0, t + 500.0, 1000))
            spans += [Span("gpu", p_, first, "compute", "attention", -1, t, t + l0, 0),
                      Span("gpu", p_, first + 1, "compute", "attention", -1, t + 200.0, t + 200.0 + l1, 0),
                      Span("gpu", p_, first + 2, "compute", "attention", -1, t + 600.0, t + 600.0 + l2, 0)]
        return spans

    def log(spans):
        return SimpleNamespace(spans=spans, pass_us=[(q, True, 1, 0.0) for q in sorted({sp[1] for sp in spans})])
    busy, quiet = run(range(10, 15), True, 120.0, 66.0, 57.0), run(range(20, 25), False, 94.0, 57.0, 57.0)
    assert start_copy_s(log(busy + quiet), 0) == pytest.approx(17e-6)
    resident = log(run(range(30, 35), False, 90.0, 55.0, 55.0))
    assert start_copy_s(log(busy), 0, resident) == pytest.approx(19e-6)
    assert start_copy_s(log(busy + quiet), 0, resident) == pytest.approx(17e-6)   # its own quiet passes first
    assert start_copy_s(log(busy), 0) is None
    assert start_copy_s(log(busy[:9] + quiet), 0) is None                          # two busy passes: under START_MIN
    up = run(range(10, 15), True, 120.0, 66.0, 57.0, first=1) + run(range(20, 25), False, 94.0, 57.0, 57.0, first=1)
    assert start_copy_s(log(up), 1) == pytest.approx(17e-6) and start_copy_s(log(up), 0) is None
