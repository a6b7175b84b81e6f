"""`oracle`: exact routing with Belady's eviction, loaded a pass ahead. Its load count is the
fewest any eviction choice can make (checked against a brute-force search on small cases), it
never computes an expert off the GPU nor skips one, and it runs in both engines."""

from functools import lru_cache
from itertools import combinations

import numpy as np
import pytest

from cmoe.core.errors import CmoeError
from cmoe.policy.policies import make_policy
from cmoe.policy.pool import PoolLayout


def fewest_loads(needs: list[tuple[int, ...]], start: frozenset, slots: int) -> int:
    """Brute force over every eviction choice: the fewest loads that serve `needs` in order."""
    @lru_cache(maxsize=None)
    def best(k: int, have: frozenset) -> int:
        if k == len(needs):
            return 0
        need = set(needs[k])
        missing = need - have
        over = len(have) + len(missing) - slots
        if over <= 0:
            return len(missing) + best(k + 1, have | missing)
        return len(missing) + min(best(k + 1, (have - set(out)) | missing)
                                  for out in combinations(sorted(have - need), over))
    return best(0, start)


def run_policy_alone(name: str, future, slots: int, E: int) -> tuple[int, list]:
    M = len(future[0])
    layout = PoolLayout((1,) * M, (slots,) * M, slots * M)
    pop = [[E - e for e in range(E)] for _ in range(M)]            # warm start: experts 0..slots-1
    pol = make_policy(name, layout, E, pop, future)
    per_pass = []
    for k, layers in enumerate(future):
        issued = list(pol.begin_pass(True, []))
        for m, need in enumerate(layers):
            p = pol.plan(m, list(need), None)
            assert sorted(p.gpu) == sorted(need) and not p.cpu and not p.skipped
            issued += p.loads
        per_pass.append([(ld.expert, ld.victim, ld.kind) for ld in issued])
    return sum(map(len, per_pass)), per_pass


@pytest.mark.parametrize("seed", range(40))
def test_oracle_makes_the_fewest_loads_any_eviction_can(seed):
    rng = np.random.default_rng(seed)
    E, slots, k_top, n = int(rng.integers(3, 7)), int(rng.integers(2, 4)), int(rng.integers(1, 3)), 12
    k_top, M = min(k_top, slots), 1 + seed % 3            # blocks are independent: the optimum adds up
    future = [[tuple(int(e) for e in rng.choice(E, k_top, replace=False)) for _ in range(M)] for _ in range(n)]
    loads, _ = run_policy_alone("oracle", future, slots, E)
    assert loads == sum(fewest_loads([f[m] for f in future], frozenset(range(slots)), slots) for m in range(M))
    lru, _ = run_policy_alone("ondemand", future, slots, E)
    assert loads <= lru


def test_oracle_by_hand_evicts_the_expert_used_furthest_ahead():
    """Slots 2, warm {0, 1}; needs 2, 0, 1, 0 (one layer). Pass 0 loads 2 over 1 (0 is needed
    first); pass 1 needs 0, resident; pass 2's 1 is loaded when pass 2 starts (a one-layer model's
    block is loaded between passes), over 2, never used again."""
    loads, per_pass = run_policy_alone("oracle", [[(2,)], [(0,)], [(1,)], [(0,)]], 2, 3)
    assert per_pass == [[(2, 1, "demand")], [], [(1, 2, "prefetch")], []]
    assert loads == 2 == fewest_loads([(2,), (0,), (1,), (0,)], frozenset({0, 1}), 2)


def test_oracle_needs_the_future():
    with pytest.raises(CmoeError, match="only a replayed trace has"):
        make_policy("oracle", PoolLayout((1,), (2,), 2), 3, [[0, 0, 0]])


def _decode_trace(needs: list[tuple[int, ...]], E: int):
    """One MoE layer, top-1, one request decoding one token per need."""
    from cmoe.core.quant import recipe
    from cmoe.core.spec import ModelSpec
    from cmoe.trace.bundle import DECODE, Trace
    spec = ModelSpec(name="tiny", family="mixtral", num_layers=1, hidden=4, expert_ffn=4, num_experts=E, top_k=1,
                     num_heads=1, num_kv_heads=1, head_dim=4, vocab=8, moe_layers=(0,))
    T = len(needs)
    ex = np.array(needs, np.int16)[:, None, :]
    return Trace(experts=ex, weights=np.ones((T, 1, 1), np.float32), pred_experts=ex.copy(),
                 request=np.zeros(T, np.int32), step=np.arange(T, dtype=np.int32), phase=np.full(T, DECODE, np.uint8),
                 spec=spec, recipe=recipe("w4a16"), expert_bytes=[[1000] * E])


def test_oracle_in_the_simulator_loads_what_the_brute_force_allows():
    from cmoe.core.hw import PROFILES
    from cmoe.sim.run import SimConfig, simulate
    needs = [(2,), (0,), (1,), (2,), (2,), (0,), (1,), (1,), (2,), (0,)]
    r = simulate(_decode_trace(needs, 3), PROFILES["h200"], SimConfig(policy="oracle", pool_gb=20, slots=2))
    warm = sorted(range(3), key=lambda e: (-sum(n[0] == e for n in needs), e))[:2]      # most used first
    assert r.run.loads == fewest_loads(needs, frozenset(warm), 2) == 3
    assert r.metrics["fallbacks"] == r.metrics["skipped"] == r.metrics["demand"] == 0
    lru = simulate(_decode_trace(needs, 3), PROFILES["h200"], SimConfig(policy="ondemand", pool_gb=20, slots=2))
    assert lru.run.loads > r.run.loads
