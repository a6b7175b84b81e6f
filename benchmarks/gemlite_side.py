"""gemlite beside the expert kernels (issue 14 asks for it in the same run as ours, torch's int4
kernel and bf16): Mobius Labs' Triton low-bit matmuls, its A16W4 grouped-INT path, on the very
codes and scales the benchmark's experts hold.

gemlite is not on the lent GPU's image and PyPI serves it as source only (0.6.0.post2), so
`benchmarks/gemlite_wheel.sh` builds a pure-Python wheel into .whl/, which every gpu_session.sh
call installs with simpy. The issue's own probe ran it "default autotune"; on a card it ships tuned
configurations for (h100.json; none for the H200 in 0.6) it loads them at import, elsewhere it
autotunes each new shape on its first call. `load` records which happened; `--gemlite-config`
names a shipped file (h100) or `autotune` (forget the shipped ones) to choose.

The conversion (`meta`) is exact in fp32 and tested on the CPU: cmoe's bf16 (scale, zero) pairs
dequantize as (q - 8) * s + z (`cmoe.executor.kernels.dequantize`); gemlite's as (q - zero) * s,
so its zero is 8 - z / s. gemlite stores that zero in the scales' dtype (bf16) and folds it into
-zero * s, so its weights differ from ours by bf16 rounding: `expert` errors are recorded beside
its times, not assumed.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

STATE: dict = {"module": None, "status": "not loaded"}


def meta(codes: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cmoe's codes int32 [out, in] (0-15) and bf16 pairs sz [in / g, out, 2] -> gemlite's (W_q uint8
    [out, in], scales [out, in / g] in sz's dtype, zeros fp32 [out, in / g]) with (W_q - zeros) * scales
    the same weights in fp32."""
    s = sz[..., 0].t().contiguous()
    z = sz[..., 1].t().float()
    return codes.to(torch.uint8), s, 8.0 - z / s.float()


def load(config: str | None = None) -> str:
    """Import gemlite (its configurations for this card as it loads them, or `config`: a shipped
    file's name, e.g. h100, or "autotune" for none); the status line the results record."""
    try:
        import gemlite
        from gemlite import core
    except Exception as e:                                                 # noqa: BLE001
        STATE.update(module=None, status=f"not importable ({type(e).__name__}: {e}); "
                                         "build its wheel with bash benchmarks/gemlite_wheel.sh")
        return STATE["status"]
    shipped = core.get_default_cache_config()
    if config == "autotune":
        gemlite.reset_config()
        how = "autotuned on first call (shipped configurations dropped)"
    elif config:
        path = os.path.join(os.path.dirname(core.__file__), "configs", f"{config}.json")
        gemlite.reset_config()
        if not gemlite.load_config(path):
            STATE.update(module=None, status=f"no configuration {path}")
            return STATE["status"]
        how = f"configurations {config}.json"
    else:
        how = f"configurations {os.path.basename(shipped)} as shipped" if shipped else \
            "autotuned on first call (no shipped configurations for this card)"
    STATE.update(module=gemlite, status=f"gemlite {gemlite.__version__}, A16W4 grouped INT, {how}")
    return STATE["status"]


def failed(what: str, e: Exception) -> None:
    """gemlite dropped for the rest of the run: `what` failed with `e`, said in the status the
    results record and printed (a failure costs its column, not the benchmark)."""
    STATE.update(module=None, status=f"gemlite failed {what}: {type(e).__name__}: {e}"[:300])
    print(STATE["status"], flush=True)


def linear(codes: torch.Tensor, sz: torch.Tensor, group: int):
    """A gemlite layer of the codes and scales (`meta`), bf16 in and out."""
    from gemlite.helper import A16Wn
    w_q, s, z = meta(codes, sz)
    return A16Wn(device=str(codes.device), dtype=torch.bfloat16).from_weights(w_q, s, z, W_nbits=4, group_size=group)


def expert(x: torch.Tensor, ex: dict) -> torch.Tensor:
    """One expert through gemlite: w13, SiLU times up, w2."""
    a, b = ex["w13"](x).chunk(2, dim=-1)
    return ex["w2"](F.silu(a) * b)

