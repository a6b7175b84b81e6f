"""A replayed trace as the executor's passes: the first `batch` requests' prefill and decode steps
(token ids, positions), and each pass's trace rows made ready before the timed run, as arrays
and as per-layer Python lists the engines' per-layer step only looks up (`replay_rows`)."""

from __future__ import annotations

import numpy as np
import torch

from cmoe.core.errors import CmoeError
from cmoe.trace.bundle import Trace


def replay_passes(w, cfg) -> list:
    """The first `batch` requests of the trace: their prefill and up to `tokens` decode steps."""
    from cmoe.trace.passes import make_passes
    t = w.trace
    reqs = np.unique(t.request)[: cfg.batch]
    if reqs.size < cfg.batch:
        raise CmoeError(f"the trace has {reqs.size} requests but --batch {cfg.batch} needs {cfg.batch}")
    out = []
    gen = np.random.default_rng(cfg.seed)
    vocab = w.spec.vocab
    for p in make_passes(t, cfg.batch, cfg.include_prefill, groups=1, decode_steps=cfg.tokens):
        sub = p.tokens
        B = cfg.batch
        n = sub.size // B
        req = t.request[sub]
        if sub.size % B or not np.array_equal(np.sort(req, kind="stable"), req) \
                or not all((req == r).sum() == n for r in reqs):
            raise CmoeError("replay needs every request of a batch to have the same number of prompt tokens "
                            "and decode steps: use --batch 1 for this trace")
        if t.token_ids is not None:
            ids = t.token_ids[sub] % vocab
        else:
            ids = gen.integers(0, vocab, sub.size)
        pos = t.step[sub].astype(np.int64)
        out.append((p, ids.reshape(B, n), pos.reshape(B, n), replay_rows(t, sub, p)))
    return out


def replay_rows(t: Trace, sub: np.ndarray, p) -> dict:
    """A pass's trace rows, and the same as per-layer Python lists (each token's experts and
    weights, its predicted experts, the pass's ranked needs), made before the timed run so the
    engines' per-layer step only looks them up."""
    ex, wt, pr = t.experts[sub], t.weights[sub], t.pred_experts[sub]
    M = ex.shape[1]
    rows = [[[e for e in r if e >= 0] for r in ex[:, m].tolist()] for m in range(M)]
    wrows = [[[v for v, e in zip(wr, er) if e >= 0] for wr, er in zip(wt[:, m].tolist(), ex[:, m].tolist())]
             for m in range(M)]
    prows = [[[e for e in r if e >= 0] for r in pr[:, m].tolist()] for m in range(M)]
    return {"experts": ex, "weights": wt, "pred": pr,
            "lists": {"route": (rows, wrows),
                      "pred": (prows, [[[1.0 / len(x)] * len(x) if x else [] for x in r] for r in prows])},
            "needed": [list(x) for x in p.needed], "predicted": [list(x) for x in p.predicted],
            "seen": [p.seen(q, t.depth) for q in range(M + 1)]}


def routes_on_device(rows: dict, dev: torch.device) -> None:
    """A replayed pass's routes as the lean engine's kernels read them ([M, N, K] int32 experts and
    fp32 weights), on the device, under rows["device"]."""
    ex, wt = rows["experts"], rows["weights"]                    # [N, M, K]
    rows["device"] = (torch.from_numpy(np.ascontiguousarray(ex.transpose(1, 0, 2)).astype(np.int32)).to(dev),
                      torch.from_numpy(np.ascontiguousarray(wt.transpose(1, 0, 2)).astype(np.float32)).to(dev))
