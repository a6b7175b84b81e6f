"""How both engines read a layer's routes back and turn them into work: each token's experts by
weight (or a replayed trace's), the predictions kept for commit, the router's scores, the plan's
experts with their rows and weights (`_assign`: the routed ones, or commit's OWA-weighted
committed ones), and the CPU experts' loop. A mixin of `cmoe.executor.engine.Engine`.
"""

from __future__ import annotations

import numpy as np
import torch

from cmoe.executor.kernels import ExpertViews, ffn
from cmoe.policy.owa import owa_weights
from cmoe.quality.measures import log_softmax
from cmoe.trace.passes import ranked


def _by_weight(idx: np.ndarray, w: np.ndarray) -> tuple[list, list]:
    """Per row, the expert ids by weight (highest first, ties in column order) and those weights."""
    order = np.argsort(-w, axis=1, kind="stable")
    return (np.take_along_axis(idx, order, 1).astype(np.int64).tolist(),
            np.take_along_axis(w, order, 1).astype(np.float64).tolist())


class Routes:
    def _ranked_rows(self, idx: np.ndarray, w: np.ndarray, m: int, kind: str) -> tuple[list, list]:
        """Per token, experts by weight (highest first) and those weights. Replay mode takes the
        trace's instead; a trace keeps no weights for its predictions, so those count as equal."""
        r = self.cur.replay
        if r is not None and "lists" in r:
            rows, ws = r["lists"][kind]
            return rows[m], ws[m]
        if r is not None:
            ex = r["pred"][:, m] if kind == "pred" else r["experts"][:, m]
            rows = [[int(e) for e in row if e >= 0] for row in ex]
            if kind == "pred":
                return rows, [[1.0 / len(x)] * len(x) for x in rows]
            return rows, [[float(v) for v, e in zip(wr, er) if e >= 0] for wr, er in zip(r["weights"][:, m], ex)]
        return _by_weight(idx, w)

    def _early_routers(self, q: int, h) -> list:
        """The routers of layers q .. q+depth-1 on the hidden state that predicts layer q ([N, H]):
        [(idx, w)], distance 1 first (only it unless the policy looks further)."""
        out = []
        self._predicting = True
        try:
            for j in range(q, min(q + self.policy.depth, self.M)):
                _, w, idx = self.gates[j](h)
                out.append((idx, w))
        finally:
            self._predicting = False
        return out

    _live_of = None                                   # the pass whose real rows `_live_rows` lists

    def _live(self) -> list[int]:
        """The pass's real rows (not padding), listed once a pass: every layer's step asks (read only)."""
        cur = self.cur
        if self._live_of is not cur:
            self._live_of, self._live_rows = cur, [i for i, a in enumerate(cur.active) if a]
        return self._live_rows

    def _ahead(self, q: int, live: list[int]) -> dict:
        """`plan`'s and `begin_pass`'s `ahead` for a policy that looks further than one layer: what
        the state predicting layer q says of layers q, q+1, ... (`Pass.seen`), ranked over the live
        rows; a replay's from its trace, a live run's from the early routers. {} for the rest, and
        in prefill, where the policies read none (a live run would read them back for nothing).

        A live run reads the distances of layers q >= 1 from layer q-1's own read-back, where
        `_deeper_parts` put them behind distance 1 (`_parse_routes` keeps where they start); layer
        0's, at the pass's start, come back in one copy of their own. Replays, which the benchmarks
        run, read the trace's predictions and copy nothing."""
        if self.policy.depth == 1 or not self.cur.decode:
            return {}
        r = self.cur.replay
        if r is not None:
            return {"ahead": r["seen"][q][: self.policy.depth]}
        deep = self._deep(q) if q < self.M else None
        if not deep:
            return {"ahead": []}
        K = deep[0][0].shape[1]
        got = getattr(self, "_rb_ahead", None)
        if got is not None and got[:2] == (self.cur.index, q):          # layer q-1's read-back holds them
            host = got[2][:, got[3]: got[3] + 2 * K * len(deep)]
            if host.shape[1] != 2 * K * len(deep):
                raise RuntimeError(f"layer {q - 1}'s read-back holds {host.shape[1]} look-ahead columns, not "
                                   f"{2 * K * len(deep)}: its parts and `_deeper_parts` disagree")
        else:                                                          # layer 0's, at the pass's start
            host = torch.cat([t.float() for idx, w in deep for t in (idx, w)], 1).cpu().numpy()   # [N, 2K a distance]
        out = []
        for k in range(len(deep)):
            rows, _ = _by_weight(host[:, 2 * K * k: 2 * K * k + K], host[:, 2 * K * k + K: 2 * K * (k + 1)])
            out.append(list(ranked([rows[i] for i in live])[0]))
        return {"ahead": out}

    def _deep(self, q: int):
        return self.deep[q]

    def _keep_prediction(self, m: int, idx: np.ndarray, w: np.ndarray) -> list[list[int]]:
        """Record each token's predicted experts for layer m (and, without OWA, their weights)."""
        rows, ws = self._ranked_rows(idx, w, m, "pred")
        self.token_pred[m] = rows
        if not self.owa:
            self.token_pred_w[m] = [dict(zip(r, x)) for r, x in zip(rows, ws)]
        return rows

    def _scores(self, logits: np.ndarray) -> np.ndarray:
        x = logits.astype(np.float64)
        return 1 / (1 + np.exp(-x)) if self.spec.scoring == "sigmoid" else np.exp(log_softmax(x))

    def _read_routes(self, m: int, idx: torch.Tensor, weights: torch.Tensor, live: list[int]):
        """The layer's one read-back: routing, (commit) router logits, the next layer's prediction.
        Returns per-token experts and weights (highest first), OWA scores, and the policy's inputs."""
        N, K = idx.shape
        decode_commit = self.commit and self.cur.decode
        parts = [idx.float(), weights.float()]
        if decode_commit:
            parts.append(self.logits[m].float().reshape(N, -1))
        nxt = self.pred_gpu[m + 1] if m + 1 < self.M else None
        if nxt is not None:
            parts += [nxt[0].float(), nxt[1].float()] + self._deeper_parts(m + 1)
        host = torch.cat(parts, 1).cpu().numpy()
        self.h_synced = self.clock.host()
        K2 = nxt[0].shape[1] if nxt is not None else 0
        return self._parse_routes(m, host, K, K2, live)

    def _parse_routes(self, m: int, host: np.ndarray, K: int, K2: int, live: list[int]):
        """The read-back's columns (top-k ids, weights, [commit: router logits], [the next layer's
        predicted ids and weights]) as `_read_routes` returns them."""
        E = self.spec.num_experts
        decode_commit = self.commit and self.cur.decode
        rows, wsorted = self._ranked_rows(host[:, :K], host[:, K:2 * K], m, "route")
        col, scores = 2 * K, None
        if decode_commit:
            scores = self._scores(host[:, col:col + E])
            col += E
        needed = list(ranked([rows[i] for i in live])[0])
        predicted = None
        if K2:
            prow = self._keep_prediction(m + 1, host[:, col:col + K2], host[:, col + K2:col + 2 * K2])
            predicted = list(ranked([prow[i] for i in live])[0])
            self._rb_ahead = (self.cur.index, m + 1, host, col)       # `_ahead` reads the distances there
        return rows, wsorted, scores, needed, predicted

    def _deeper_parts(self, q: int) -> list:
        """A live decode pass's predictions of layers q+1.. (distances 2..) from the state that
        predicts layer q, as read-back columns (idx, w per distance) behind distance 1's: one
        copy with the layer's own read-back, where a copy of their own would queue on the compute
        stream behind the layer's experts. Empty for replays (their trace holds them) and prefill."""
        if self.policy.depth == 1 or not self.cur.decode or self.cur.replay is not None or q >= self.M:
            return []
        return [t.float() for idx, w in self._deep(q)[1:] for t in (idx, w)]

    def _assign(self, m, plan, rows, wsorted, scores, live, K) -> dict[int, list[tuple[int, float]]]:
        """expert -> [(row, weight)]: the routed experts with the router's weights, or, for commit
        in decode, each token's own predicted experts among the committed ones with OWA weights."""
        assign: dict[int, list[tuple[int, float]]] = {}
        if self.commit and self.cur.decode:
            chosen = set(plan.gpu)
            for i in live:
                mine = [e for e in dict.fromkeys(self.token_pred[m][i]) if e in chosen]
                if not mine:                       # none of its guesses was committed: its best committed
                    mine = [max(plan.gpu, key=lambda e: scores[i][e])]
                if self.owa:
                    ws = owa_weights(scores[i].tolist(), mine, K, self.spec.renormalize, self.spec.scaling)
                else:                              # trust the early router: its own weights, as predicted
                    pw = self.token_pred_w[m][i]
                    ws = [pw.get(e, 0.0) for e in mine]
                for e, w in zip(mine, ws):
                    assign.setdefault(e, []).append((i, w))
        else:
            for i in live:
                for e, w in zip(rows[i], wsorted[i]):
                    assign.setdefault(e, []).append((i, w))
        return assign

    def _cpu_experts(self, m, d, cpu, order, wmat, hidden, x_host, out) -> None:
        clock = self.clock
        x = x_host if x_host is not None else hidden
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for e in cpu:
            j = order.index(e)
            r = torch.from_numpy(np.nonzero(wmat[j])[0])
            h0 = clock.host()
            v = self._cpu_views.get((m, e))
            if v is None:
                v = self._cpu_views[(m, e)] = ExpertViews(self.store.layout, self.store.cpu_expert(m, e), "cpu")
            y = ffn(x.index_select(0, r), v, self.act).float()
            acc.index_add_(0, r, y * torch.from_numpy(wmat[j]).index_select(0, r)[:, None])
            self._span(d, "cpu", "cpu_expert", e, h0, clock.host(), self.store.slot)
        h0 = clock.host()
        out.add_(acc.to(self.device, out.dtype))
        if self.cuda:
            self._span(d, "cpu", "roundtrip", -1, h0, clock.host(), acc.numel() * out.element_size())

    # --- spans ----------------------------------------------------------------------------
