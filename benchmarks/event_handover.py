"""The host program's timing events handed over at a pass boundary, on the CPU (twenty-fifth
session, 1cd3f4c): before, every pass took all K events from the clock's free list into the
program's array and gave the unused ones back; since, only the n the last pass recorded are
replaced. K as `lean_fast._hp_setup` sizes it for Mixtral (402 at batch 1, 786 at batch 8), a
quarter of them used; us a pass, the best of three loops of 2,000 passes.

    python benchmarks/event_handover.py
"""

from __future__ import annotations

import time

import numpy as np


def per_pass(K: int, n: int, refill_only: bool, passes: int = 2000) -> float:
    free = list(range(100_000, 100_000 + n * passes + K + 10))
    ev = np.zeros(K, np.int64)
    t0 = time.perf_counter()
    for _ in range(passes):
        if refill_only:                      # 1cd3f4c: the n recorded ones replaced
            ev[:n] = free[-n:]
            del free[-n:]
        else:                                # before: all K taken, the unused K - n given back
            ev[:] = free[-K:]
            del free[-K:]
            free.extend(ev[n:].tolist())
    return (time.perf_counter() - t0) / passes * 1e6


def main() -> None:
    print("| events K | used n | all K handed over, us a pass | the n used replaced, us a pass |")
    print("| ---: | ---: | ---: | ---: |")
    for K in (402, 786):
        n = K // 4
        old = min(per_pass(K, n, False) for _ in range(3))
        new = min(per_pass(K, n, True) for _ in range(3))
        print(f"| {K} | {n} | {old:.1f} | {new:.1f} |")


if __name__ == "__main__":
    main()
