"""The Python API: what the CLI does, as functions (top floor, beside the CLI and `pipeline`).

```python
import cmoe
t = cmoe.load_trace("synthetic:mixtral-8x7b")
for r in cmoe.simulate(t, pool_gb=20, policies=["commit", "oracle"]):
    print(r.metrics["policy"], r.metrics["tokens_per_s"])
```

`import cmoe` stays light: these names load their modules (and torch, for `execute`) on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cmoe.core.errors import CmoeError
from cmoe.core.hw import HardwareProfile, load_profile
from cmoe.trace.bundle import Trace
from cmoe.trace.load import load_trace

__all__ = ["load_trace", "simulate", "execute", "CmoeError"]


def _policies(policies: str | Sequence[str]) -> list[str]:
    from cmoe.policy.policies import POLICIES
    names = list(POLICIES) if policies == "all" else [policies] if isinstance(policies, str) else list(policies)
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise CmoeError(f"unknown policy '{bad[0] if bad else ''}': choose from {', '.join(POLICIES)}")
    return names


def simulate(trace: Trace | str, *, profile: str | HardwareProfile = "h200", policies: str | Sequence[str] = "all",
             pool_gb: float = 20.0, batch: int = 1, slots: int | None = None) -> list:
    """Simulate each policy on a trace (a Trace, a bundle path, `embedded` or `synthetic:PRESET`).
    Returns one `cmoe.sim.run.SimResult` per policy: `.metrics` (the row `cmoe simulate` prints,
    defined in `cmoe.core.metrics`) and `.run` (spans and per-pass counts). "all": every policy the
    profile can price (a warning names any it cannot, `cmoe.sim.priced.priceable`); a policy named
    that it cannot price is refused before the trace is read."""
    from cmoe.sim.priced import priceable
    from cmoe.sim.run import SimConfig
    from cmoe.sim.run import simulate as one
    prof = load_profile(profile) if isinstance(profile, str) else profile
    names, note = priceable(prof, _policies(policies), every=policies == "all")
    if note:
        import warnings
        warnings.warn(f"cmoe.simulate: {note}", stacklevel=2)
    t = load_trace(trace, None, batch) if isinstance(trace, str) else trace
    return [one(t, prof, SimConfig(policy=p, pool_gb=pool_gb, batch=batch, slots=slots)) for p in names]


def execute(*, spec: str | None = None, model: str | Path | None = None, trace: str | None = None,
            policies: str | Sequence[str] = "commit", pool_gb: float = 20.0, batch: int = 1, tokens: int = 256,
            device: str = "cuda", quant: str | None = None, slots: int | None = None) -> list:
    """Run policies for real (torch): random weights at a preset's shapes (`spec`, with `trace`)
    or a local checkpoint (`model`, live routing unless `trace`). Returns one
    `cmoe.executor.run.ExecResult` per policy with `.metrics` and `.log` (the measured timeline).
    OpenMP's threads spin for CPU experts on a GPU as the CLI sets it, where torch is not loaded yet
    (`cmoe.executor.omp_wait`; `.metrics["omp_wait_policy"]` says what held, with any binding)."""
    from cmoe.executor.omp_wait import LATE, for_policies
    names = _policies(policies)
    if LATE in (said := for_policies(device, names) or ""):   # the CLI prints it; a library warns
        import warnings
        warnings.warn(f"cmoe.execute: {said}: set it before importing torch", stacklevel=2)
    try:
        from cmoe.executor.run import ExecConfig
        from cmoe.executor.run import execute as run
        from cmoe.executor.run import prepare
    except ImportError as e:
        raise CmoeError(f"cmoe.execute needs torch and transformers ({e.name} is missing): "
                        f"pip install 'cmoe[torch]'") from None
    cfg = ExecConfig(policies=tuple(names), pool_gb=pool_gb, batch=batch, tokens=tokens,
                     device=device, quant=quant, slots=slots)
    w, cfg = prepare(spec_name=spec, model_dir=Path(model) if model is not None else None, trace_src=trace,
                     data=None, cfg=cfg)
    return run(w, cfg)
