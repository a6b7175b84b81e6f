"""The compiled host program's call at a pass boundary, on the CPU (twenty-sixth session): through
numba's dispatcher, which types every array of the arguments on every call, against the entry
point `host_program.compile_for` returns (the engine's call since then). The arguments are the
engine's for Mixtral-8x7B (32 MoE layers, 8 experts, top 2) at batch 1 and 8, an lru-prefetch
state over a synthetic trace; the function called is a no-op compiled for their types, so the
figure is the call's own cost, which the GPU waits for at every pass boundary. us a call, the best
of five loops of 2,000 calls.

    python benchmarks/program_call.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cmoe.core.quant import recipe  # noqa: E402
from cmoe.core.spec import preset  # noqa: E402
from cmoe.executor import host_program as hp  # noqa: E402
from cmoe.policy.policies import make_policy  # noqa: E402
from cmoe.policy.pool import PoolLayout  # noqa: E402
from cmoe.sim.replay.state import export, pass_data  # noqa: E402
from cmoe.sim.replay.twin_pool import decisions  # noqa: E402
from cmoe.trace.pass_arrays import Future, build  # noqa: E402
from cmoe.trace.passes import popularity  # noqa: E402
from cmoe.trace.synthetic import SyntheticParams, generate  # noqa: E402


@njit(cache=False, _nrt=False)
def _noop(prog, pool, s, d, pd, b, gbase, p, P, ts, waves):
    return p


def arguments(batch: int) -> tuple:
    """The program's arguments as `lean_fast._hp_setup` makes them, in the engine's shapes."""
    spec = preset("mixtral-8x7b")
    M, E, S, W = spec.num_moe_layers, spec.num_experts, 6, 3
    t = generate(spec, recipe("w4a16"), SyntheticParams(requests=batch, prompt_len=8, decode_len=32))
    pa = build(t, batch)
    lay = PoolLayout(slot_bytes=(1,) * M, slots=(S,) * M, budget_bytes=S * M)
    pol = make_policy("lru-prefetch", lay, E, popularity(t), Future(pa))
    z = lambda *shape: np.zeros(shape, np.int64)
    prog = hp.Prog(z(M, 4), z(11), z(M, 4), z(M), np.zeros((M, W, E), np.int32), z(M, W), z(M, S), z(M, E),
                   **hp.no_commit(M), **hp.no_live(M), fn=z(6))
    marks = 2 + M * (4 + 4 * W + 2 * E) + 6 * E
    return (prog, hp.pool_of(np.full((M, S), -1, np.int64)), export(pol, pa), decisions(M + 1, 1, E), pass_data(pa),
            hp.books(M, E, S, W, marks), 0, 1, pa.num_passes, z(2), z(E))


def per_call(fn, args: tuple, calls: int = 2000) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    print("| batch | arrays in the arguments | dispatcher, us a call | entry point, us a call |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in (1, 8):
        args = arguments(batch)
        entry = hp.compile_for(_noop, *args)
        n = sum(sum(isinstance(x, np.ndarray) for x in a) if isinstance(a, tuple) else isinstance(a, np.ndarray)
                for a in args)
        assert entry(*args) == _noop(*args) == 1
        print(f"| {batch} | {n} | {per_call(_noop, args):.2f} | {per_call(entry, args):.2f} |")


if __name__ == "__main__":
    main()
