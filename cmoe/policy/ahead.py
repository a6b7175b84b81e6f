"""Policies that look several layers ahead (issue 16): one load takes ~1.7 ms on the default
study and one layer's compute ~0.4 ms, so a prefetch issued one layer early hides a fifth of a
load; issued d layers early it can hide all of it. Both read, at layer m's plan, what the hidden
state of layer m predicts of layers m+1 .. m+depth (`ahead[k-1]`: layer m+k at distance k; at a
pass's start, what the state before layer 0 predicts of layers 0 .. depth-1): the routers of
those layers applied to it, which a live run has by then (`Pass.seen`).

Eviction by predicted next use: an expert some prediction of this pass names for a layer still
to come is kept (`wanted`); among the rest the least popular goes (the trace's own counts, the
ranking `warm` fills the pool by), so a wrong or early prefetch displaces a cold expert, not one
the next pass is likely to want. An expert prefetched in this pass into a block whose layer has
not run yet is never a victim (its copy may still be on its way: evicting it queues a second
copy into the same slot, which a read of that slot would then wait behind); so that a commit or a
demand load always finds a victim, prefetches leave two slots of each block to the rest.

| policy | what it does in decode |
| --- | --- |
| adaptive-ahead | `adaptive` (the pass's top-ranked expert always, loaded if missing; the rest only if resident) plus a prefetch of each predicted top-1 of layers m+1 .. m+depth, predicted-next-use eviction |
| commit-ahead | `commit` (layer m+1 computes only what layer m committed, OWA weights) plus a prefetch of layers m+2 .. m+depth's predictions, predicted-next-use eviction |

Pure Python, like every policy: the simulator and the executor call the same objects. The
mechanics live here (`Ahead`, a mixin that imports nothing); the two classes, in
`cmoe.policy.policies` beside the policies they extend.
"""

from __future__ import annotations

DEPTH = 4                 # layers ahead (the synthetic and embedded traces record 4 distances)


class Ahead:
    """The shared mechanics: what this pass's predictions want per block, the eviction that keeps
    it, and the prefetches (mixed into a Policy subclass, ahead of it in the MRO)."""
    depth = DEPTH
    top = 1                         # experts of each prediction prefetched (1: its top-1)
    agree = 2                       # predictions of this pass (any distance) that must name an expert first

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._reset()

    def _reset(self) -> None:
        self.wanted: list[set[int]] = [set() for _ in self.layout.slots]
        self.fresh: list[set[int]] = [set() for _ in self.layout.slots]   # prefetched this pass, layer not run
        self.named: list[dict[int, int]] = [{} for _ in self.layout.slots]  # expert -> predictions naming it

    def _ran(self, m: int) -> None:
        """Layer m is being planned: what was wanted or fetched for it no longer binds."""
        self.wanted[m].clear()
        self.fresh[m].clear()
        self.named[m].clear()

    def victim(self, m, protect):
        free = [v for v in self.pool.where[m] if v not in protect and v not in self.fresh[m]]
        cold = [v for v in free if v not in self.wanted[m]]
        if not cold:                # every candidate is wanted: the oldest, as LRU does
            return free[0] if free else None
        return min(cold, key=lambda v: (self.popularity[m][v], v))

    def _prefetch(self, first: int, ahead: list[list[int]] | None) -> list:
        """Prefetch `ahead[k][:top]` into block first + k, nearest layer first."""
        loads: list = []
        for k, guess in enumerate(ahead or ()):
            j = first + k
            if j >= len(self.layout.slots):
                break
            named = self.named[j]
            for e in guess[: self.top]:
                named[e] = named.get(e, 0) + 1
            want = [e for e in guess[: self.top] if named[e] >= self.agree]
            self.wanted[j].update(want)
            room = self.layout.slots[j] - 2 - len(self.fresh[j])
            if room > 0:
                got, placed = self.ensure(j, want[:room], "prefetch", protect=set(want))
                self.fresh[j].update(placed)
                loads += got
        return loads
