"""Policies on small hand-made cases: exact decisions, no simpy, no torch."""

import pytest

from cmoe.core.errors import CmoeError
from cmoe.policy.owa import owa_weights
from cmoe.policy.policies import Load, make_policy
from cmoe.policy.pool import PoolLayout, SlotPool, VariableAllocator, plan_layout

# two layers, four experts, two slots each; popularity decides the warm contents: [0, 1] and [3, 2]
LAYOUT = PoolLayout(slot_bytes=(100, 100), slots=(2, 2), budget_bytes=400)
POP = [[5, 4, 1, 0], [0, 1, 2, 3]]


def pol(name):
    return make_policy(name, LAYOUT, 4, POP)


def test_warm_start_by_popularity():
    p = pol("ondemand")
    assert p.pool.residents(0) == [0, 1] and p.pool.residents(1) == [3, 2]
    assert [p.pool.slot_of(0, e) for e in (0, 1)] == [0, 1]


def test_ondemand_loads_misses_and_evicts_lru():
    p = pol("ondemand")
    plan = p.plan(0, [2, 1], None)
    assert plan.gpu == [1, 2] and plan.loads == [Load(0, 2, 0, 0, "demand")]
    assert p.pool.residents(0) == [1, 2]
    plan = p.plan(0, [0], None)                  # 1 is now the oldest
    assert plan.loads == [Load(0, 0, 1, 1, "demand")] and plan.slots == {0: 1}


def test_needed_beyond_capacity_reuses_a_slot_planned_earlier_in_the_layer():
    p = pol("ondemand")
    plan = p.plan(0, [0, 1, 2], None)            # three needed, two slots
    assert plan.gpu == [0, 1, 2] and plan.loads == [Load(0, 2, 0, 0, "demand")]
    assert plan.slots == {0: 0, 1: 1, 2: 0}


def test_lru_prefetch_guesses_the_next_layer():
    p = pol("lru-prefetch")
    plan = p.plan(0, [0], [1, 3])
    # layer 1 holds [3, 2] in LRU order; guesses go in order: 1 evicts 2 (3 is protected), then 3 is touched
    assert plan.gpu == [0] and plan.loads == [Load(1, 1, 1, 2, "prefetch")]
    assert p.pool.residents(1) == [1, 3]


def test_lfu_fallback_runs_misses_on_the_cpu_and_admits_hot_ones():
    p = pol("lfu-fallback")
    p.freq[0][:2] = [5, 5]                   # residents used more often than the miss: not admitted
    plan = p.plan(0, [2], None)
    assert plan.gpu == [] and plan.cpu == [2] and plan.loads == []
    p.freq[0][:2] = [0, 3]                   # now freq[2] = 2 > freq[0] = 0: admitted over expert 0
    plan = p.plan(0, [2, 1], None)
    assert plan.gpu == [1] and plan.cpu == [2] and plan.loads == [Load(0, 2, 0, 0, "admit")]


def test_static_never_loads():
    p = pol("static")
    plan = p.plan(1, [0, 3], [1])
    assert plan.gpu == [3] and plan.cpu == [0] and plan.loads == []


def test_commit_commits_next_layer_and_computes_only_committed():
    p = pol("commit")
    assert p.begin_pass(True, [2, 0]) == [Load(0, 2, 1, 1, "commit")]
    plan = p.plan(0, [0, 3], [1])
    assert plan.gpu == [2, 0] and plan.skipped == [3] and plan.cpu == []
    assert plan.loads == [Load(1, 1, 0, 3, "commit")]
    plan = p.plan(1, [1, 2], None)
    assert plan.gpu == [1] and plan.skipped == [2]


def test_commit_truncates_to_capacity_and_prefill_is_exact():
    p = pol("commit")
    assert p.begin_pass(False, [2, 3]) == []
    plan = p.plan(0, [2, 3], [0, 1, 2])
    assert plan.skipped == [] and sorted(plan.gpu) == [2, 3]
    p.begin_pass(True, [0, 1, 2])
    assert p.committed[0] == [0, 1]


def test_owa_by_hand():
    scores = [0.5, 0.3, 0.15, 0.05]
    # prediction right: exact-routing weights back
    assert owa_weights(scores, [0, 1], 2, renormalize=True) == pytest.approx([0.625, 0.375])
    # committed {1, 2}: true scores restricted and renormalised to the top-2 mass
    assert owa_weights(scores, [1, 2], 2, renormalize=True) == pytest.approx([0.3 / 0.45, 0.15 / 0.45])
    assert owa_weights(scores, [1, 2], 2, renormalize=False) == pytest.approx([0.3 / 0.45 * 0.8, 0.15 / 0.45 * 0.8])
    assert owa_weights(scores, [3], 2, renormalize=True, scaling=2.0) == pytest.approx([2.0])


def test_layout_and_too_small_pool():
    lay = plan_layout([100, 200], num_experts=8, budget_bytes=1000, min_slots=2)
    assert lay.slots == (4, 3) and lay.used_bytes == 1000
    with pytest.raises(CmoeError, match="needs at least 2 slots"):
        plan_layout([100, 200], num_experts=8, budget_bytes=500, min_slots=2)
    assert plan_layout([100], 4, 10_000, 1).slots == (4,)


def test_variable_allocator_fragments():
    a = VariableAllocator(2048)
    assert a.alloc("a", 512) == 0 and a.alloc("b", 1024) == 512 and a.alloc("c", 512) == 1536
    a.free("a")
    a.free("c")
    assert a.free_bytes == 1024 and a.alloc("d", 1024) is None       # 1 KiB free, in two holes
    a.free("b")
    assert a.holes == [(0, 2048)]


def test_pool_place_asserts():
    pool = SlotPool(PoolLayout((10,), (1,), 10))
    pool.place(0, 3, None)
    with pytest.raises(AssertionError, match="no free slot"):
        pool.place(0, 4, None)


def test_policies_are_described_by_traits():
    """The engines read traits, not names: which policy holds every expert, which computes on the
    CPU, which commits; an unknown name has none."""
    from cmoe.policy.policies import POLICIES, trait
    got = {t: sorted(p for p in POLICIES if trait(p, t)) for t in ("holds_all", "cpu_experts", "commits", "skips",
                                                                   "uses_prediction", "uses_future")}
    assert got == {"holds_all": ["upper"], "cpu_experts": ["lfu-fallback", "static"],
                   "commits": ["commit", "commit-ahead"],
                   "skips": ["adaptive", "adaptive-ahead", "commit", "commit-ahead"],
                   "uses_prediction": ["adaptive-ahead", "commit", "commit-ahead", "lru-prefetch"],
                   "uses_future": ["oracle"]}
    assert not trait("magic", "holds_all")


def test_adaptive_loads_only_the_top_ranked_and_runs_the_resident_rest():
    """adaptive in decode: the top-ranked expert runs (loaded if missing), a lower-ranked one only
    if resident, the rest are skipped; prefill is exact."""
    from cmoe.policy.policies import make_policy
    pol = make_policy("adaptive", PoolLayout((1000,), (3,), 0), 6, [[9, 8, 7, 0, 0, 0]])
    assert list(pol.pool.where[0]) == [0, 1, 2]
    pol.begin_pass(False, [])
    p = pol.plan(0, [4, 1, 5], None)                     # prefill: exact, two loads
    assert p.gpu == [1, 4, 5] and [ld.expert for ld in p.loads] == [4, 5] and p.skipped == []
    pol.begin_pass(True, [])
    p = pol.plan(0, [3, 5, 0, 4], None)                  # 3 missing: loaded; 5 and 4 resident; 0 evicted
    assert [ld.expert for ld in p.loads] == [3] and p.gpu == [5, 4, 3] and p.skipped == [0]
    p = pol.plan(0, [5, 2], None)                        # top-1 resident, 2 gone: no load
    assert p.loads == [] and p.gpu == [5] and p.skipped == [2]


AHEAD_LAYOUT = PoolLayout((1000,) * 4, (4,) * 4, 0)      # four blocks of four slots, six experts
AHEAD_POP = [[6, 5, 4, 3, 2, 1]] * 4                     # warm: experts 0-3 in slots 0-3 of every block


def test_adaptive_ahead_prefetches_what_two_predictions_agree_on():
    """Layer m's plan sees layer m's predictions of layers m+1.. (ahead[k-1]: layer m+k); an
    expert is fetched once two of the pass's predictions name it first; the victim is the least
    popular resident nobody wants."""
    pol = make_policy("adaptive-ahead", AHEAD_LAYOUT, 6, AHEAD_POP)
    assert pol.depth == 4 and pol.agree == 2 and pol.top == 1
    assert pol.begin_pass(True, [0, 1], ahead=[[0, 1], [4, 0], [5, 1]]) == []       # each named once
    p = pol.plan(0, [1, 2], [4, 3], ahead=[[4, 3], [5, 2], [4, 1]])
    assert p.gpu == [1, 2] and p.skipped == []
    assert p.loads == [Load(1, 4, 3, 3, "prefetch"), Load(2, 5, 3, 3, "prefetch")]  # 4 named for layer 3 once
    p = pol.plan(1, [4, 0], [5, 0], ahead=[[5, 0], [2, 4]])
    assert p.gpu == [4, 0] and p.loads == []                                      # 5 is there already
    p = pol.plan(2, [2, 3], [1, 0], ahead=[[1, 0]])                               # 3 was evicted: skipped
    assert p.gpu == [2] and p.skipped == [3] and p.loads == []
    p = pol.plan(3, [5, 1], None, ahead=[])                                       # top-1 missing: loaded on demand
    assert p.gpu == [1, 5] and p.loads == [Load(3, 5, 3, 3, "demand")]


def test_ahead_keeps_wanted_and_in_flight_experts_and_leaves_two_slots():
    """A wanted expert is not a victim while a colder one is; an expert fetched in this pass for a
    layer still to come is never one; prefetches leave two slots of a block to commits and demand
    loads."""
    pol = make_policy("adaptive-ahead", PoolLayout((1000,) * 2, (5,) * 2, 0), 6, [[6, 5, 4, 3, 2, 1], [6, 0, 4, 1, 3, 2]])
    assert dict(pol.pool.where[1]) == {0: 0, 2: 1, 4: 2, 5: 3, 3: 4}           # 1 is out, 3 the coldest in

    def twice(e):
        pol.plan(0, [0], [e], ahead=[[e]])
        return pol.plan(0, [0], [e], ahead=[[e]]).loads

    pol.begin_pass(True, [0], ahead=[[0], [3]])
    assert pol.plan(0, [0], [3], ahead=[[3]]).loads == [] and pol.wanted[1] == {3}
    assert twice(1) == [Load(1, 1, 3, 5, "prefetch")]          # 3 is wanted: 5 goes, the coldest other
    assert twice(5) == [Load(1, 5, 2, 4, "prefetch")]          # 1 is in flight, 3 wanted: 4 goes
    assert twice(4) == [Load(1, 4, 1, 2, "prefetch")] and pol.fresh[1] == {1, 5, 4}
    assert twice(2) == []                                      # three fetched into five slots: no room left
    p = pol.plan(1, [2, 3], None, ahead=[])                    # layer 1 runs: nothing binds, 2 comes back
    assert p.gpu == [3, 2] and p.loads == [Load(1, 2, 3, 1, "demand")] and pol.fresh[1] == set()   # over the coldest


def test_commit_ahead_commits_the_next_layer_and_prefetches_the_ones_after():
    pol = make_policy("commit-ahead", AHEAD_LAYOUT, 6, AHEAD_POP)
    loads = pol.begin_pass(True, [4, 0], ahead=[[4, 0], [5, 1], [5, 2]])
    assert loads == [Load(0, 4, 3, 3, "commit")] and pol.committed[0] == [4, 0]
    p = pol.plan(0, [0, 2], [5, 1], ahead=[[5, 1], [5, 3], [4, 0]])
    # layer 1 committed [5, 1] (5 over the coldest, 3); layer 2: 5 named twice, fetched over 3
    assert p.gpu == [4, 0] and p.skipped == [2] and pol.committed[1] == [5, 1]
    assert p.loads == [Load(1, 5, 3, 3, "commit"), Load(2, 5, 3, 3, "prefetch")]
