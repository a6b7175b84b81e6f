"""Compile the replay once, ahead of its first use (numba caches it on disk): a tiny simulation
under every policy. `python -m cmoe.sim.replay.warm`; scripts/setup runs it."""

from __future__ import annotations

import time


def warm() -> float:
    """Run every compiled path once; returns the seconds it took (about 30 s cold, 0.3 s cached)."""
    from cmoe.core.hw import H200
    from cmoe.core.quant import recipe
    from cmoe.sim.run import SimConfig, simulate
    from cmoe.core.spec import preset
    from cmoe.trace.synthetic import SyntheticParams, generate
    t0 = time.perf_counter()
    t = generate(preset("mixtral-8x7b"), recipe("w4a16"), SyntheticParams(requests=1, prompt_len=2, decode_len=2))
    for policy in ("ondemand", "oracle"):
        simulate(t, H200, SimConfig(policy=policy, pool_gb=20, engine="replay"), timeline=True)
    return time.perf_counter() - t0


if __name__ == "__main__":
    import numba
    print(f"compiled the replay in {warm():.1f} s (cache: {numba.config.CACHE_DIR})")
