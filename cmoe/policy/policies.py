"""The six policies as pure decisions over a SlotPool: which experts run on the GPU, which on the
CPU, which loads to issue and which slot each overwrites. The simulator and the executor call
these same objects and differ only in how time passes.

Per pass (a prefill or one decode step of a batch) the engine calls `begin_pass`, then for each
MoE layer m, once its router has run, `plan(m, needed, predicted_next)`: `needed` is the exact
routing (the union over the batch's tokens, most-voted first), `predicted_next` the commit
prediction for layer m+1 made from layer m's hidden state. Loads in a plan are issued at once, in
order; the layer's GPU compute waits only for the experts in `plan.gpu`. A victim is never an
expert the current or the next layer still needs; when a batch needs more experts than a block
has slots, an expert already planned earlier in the same layer may be overwritten, and the
engine then waits for its kernel to finish before the copy starts.

| policy | stands for |
| --- | --- |
| upper | every expert resident (unlimited memory) |
| ondemand | blocking load of each missing expert, LRU eviction |
| lru-prefetch | mixtral-offloading: per-layer LRU + speculative prefetch of layer m+1's predicted experts, exact routing |
| lfu-fallback | MoE-Infinity: LFU eviction; a miss runs on the CPU, and is admitted to the pool in the background if it is used more often than the victim |
| static | Fiddler/ktransformers: each layer's most used experts pinned, the rest on the CPU |
| commit | CommitMoE: layer m+1's prediction is committed while layer m runs and loaded at once; layer m+1 computes only committed experts (OWA re-weights them); nothing on the CPU |
| oracle | the bound: exact routing, Belady eviction (the resident used furthest in the future goes) and about a pass of lookahead (once a layer has run, its block is loaded for its next pass), from the trace's future |
| adaptive | cache-aware top-k: in decode each layer runs the pass's top-ranked expert (loaded on demand if missing, LRU) and a lower-ranked one only if it is resident; the rest are skipped, their weight dropped (not re-normalised) |
| adaptive-ahead | adaptive, plus a prefetch of the predicted top-1 of layers m+1..m+4 made from layer m's hidden state, and eviction by predicted next use (`cmoe.policy.ahead`) |
| commit-ahead | commit, plus a prefetch of layers m+2..m+4's predictions, and eviction by predicted next use (`cmoe.policy.ahead`) |

Prefill passes are exact for every policy (commit included): a prompt touches nearly every
expert, so committing a subset would change the outputs of many tokens for no saving.
"""

from __future__ import annotations

from bisect import bisect_right

from cmoe.policy.ahead import Ahead
from cmoe.policy.base import LayerPlan, Load, Policy
from cmoe.policy.pool import PoolLayout

POLICIES = ("upper", "ondemand", "lru-prefetch", "lfu-fallback", "static", "commit", "oracle", "adaptive",
            "adaptive-ahead", "commit-ahead")


class Upper(Policy):
    name = "upper"
    holds_all = True

    def plan(self, m, needed, predicted_next):
        return LayerPlan(gpu=list(needed), slots={e: self.pool.slot_of(m, e) for e in needed})


class OnDemand(Policy):
    name = "ondemand"

    def plan(self, m, needed, predicted_next):
        return self.exact_plan(m, needed)


class LruPrefetch(Policy):
    name = "lru-prefetch"
    uses_prediction = True

    def plan(self, m, needed, predicted_next):
        p = self.exact_plan(m, needed)
        if predicted_next is not None and m + 1 < len(self.layout.slots):
            guess = predicted_next[: self.layout.slots[m + 1]]
            loads, _ = self.ensure(m + 1, guess, "prefetch", protect=set(guess))
            p.loads += loads
        return p


class LfuFallback(Policy):
    name = "lfu-fallback"
    cpu_experts = True

    def victim(self, m, protect):
        cands = [v for v in self.pool.where[m] if v not in protect]
        return min(cands, key=lambda v: self.freq[m][v]) if cands else None

    def plan(self, m, needed, predicted_next):
        for e in needed:
            self.freq[m][e] += 1
        gpu = [e for e in needed if self.pool.resident(m, e)]
        cpu = [e for e in needed if e not in gpu]
        loads = []
        for e in cpu:                               # admit in the background if hotter than the victim
            v = None if self.pool.has_free(m) else self.victim(m, set(needed))
            if self.pool.has_free(m) or (v is not None and self.freq[m][v] < self.freq[m][e]):
                loads.append(Load(m, e, self.pool.place(m, e, v), v, "admit"))
        return LayerPlan(gpu=gpu, cpu=cpu, loads=loads, slots={e: self.pool.slot_of(m, e) for e in gpu})


class Static(Policy):
    name = "static"
    cpu_experts = True

    def plan(self, m, needed, predicted_next):
        gpu = [e for e in needed if self.pool.resident(m, e)]
        return LayerPlan(gpu=gpu, cpu=[e for e in needed if e not in gpu],
                         slots={e: self.pool.slot_of(m, e) for e in gpu})


class Commit(Policy):
    name = "commit"
    commits = True
    skips = True
    uses_prediction = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.committed: list[list[int] | None] = [None] * len(self.layout.slots)

    def commit(self, m: int, predicted: list[int]) -> list[Load]:
        """Load the first `slots` predicted experts of layer m and commit to those that found a
        slot: all of them for commit (it protects what it commits), fewer for commit-ahead when its
        fetched experts fill the block (batch > 1)."""
        chosen = predicted[: self.layout.slots[m]]
        loads, _ = self.ensure(m, chosen, "commit", protect=set(chosen))
        self.committed[m] = [e for e in chosen if self.pool.resident(m, e)]
        return loads

    def begin_pass(self, decode, pred0):
        self.decode = decode
        self.committed = [None] * len(self.layout.slots)
        return self.commit(0, pred0) if decode else []

    def plan(self, m, needed, predicted_next):
        if not self.decode:
            return self.exact_plan(m, needed)
        chosen = self.committed[m]
        assert chosen is not None, f"layer {m} was never committed"
        for e in chosen:
            self.pool.touch(m, e)
        p = LayerPlan(gpu=list(chosen), skipped=[e for e in needed if e not in chosen],
                      slots={e: self.pool.slot_of(m, e) for e in chosen})
        if predicted_next is not None and m + 1 < len(self.layout.slots):
            p.loads = self.commit(m + 1, predicted_next)
        return p


class Oracle(Policy):
    """What the hardware allows with exact routing: every load Belady's optimal eviction must make
    (per block, the resident whose next use lies furthest ahead is evicted, one never used again
    first), each issued about as early as it can be: once layer m's kernels are issued (at layer
    m+1's plan; the last layer's at the next pass's start), block m is loaded with what layer m
    needs in the next pass, so a load has about a pass to land. Waiting one layer keeps every
    eviction free: a slot the layer has just read or loaded may go, its copy queued behind the
    kernel. Needs the future: `future[k][m]`, the experts pass k needs in layer m."""
    name = "oracle"
    uses_future = True

    def __init__(self, layout, num_experts, popularity, future=None):
        super().__init__(layout, num_experts, popularity, future)
        assert future is not None, "oracle needs the trace's future"
        self.future = future
        self.k = -1                                       # the pass being run
        self._uses: list[dict[int, list[int]]] | None = None
        self.after = 0                                    # victims are judged by their next use after this pass

    @property
    def uses(self) -> list[dict[int, list[int]]]:
        """[m] expert -> the passes needing it, ascending; built on first use (the compiled
        replay reads the future from its own arrays and never needs it)."""
        if self._uses is None:
            self._uses = [{} for _ in self.layout.slots]
            for k, layers in enumerate(self.future):
                for m, need in enumerate(layers):
                    for e in need:
                        self._uses[m].setdefault(e, []).append(k)
        return self._uses

    def next_use(self, m: int, e: int) -> float:
        ks = self.uses[m].get(e, ())
        i = bisect_right(ks, self.after)
        return ks[i] if i < len(ks) else float("inf")

    def victim(self, m, protect):
        cands = [v for v in self.pool.where[m] if v not in protect]
        return max(cands, key=lambda v: (self.next_use(m, v), v)) if cands else None

    def _ahead(self, m: int, k: int) -> list[Load]:
        """Load block m with what pass k needs there (victims judged from pass k on)."""
        if not 0 <= k < len(self.future):
            return []
        need = list(self.future[k][m])
        self.after = k
        return self.ensure(m, need, "prefetch", protect=set(need))[0]

    def begin_pass(self, decode, pred0):
        self.decode = decode
        self.k += 1
        return self._ahead(len(self.layout.slots) - 1, self.k) if self.k else []

    def plan(self, m, needed, predicted_next):
        assert list(needed) == list(self.future[self.k][m]), f"pass {self.k} layer {m}: the future disagrees with the trace"
        self.after = self.k
        p = self.exact_plan(m, needed)
        if m:
            p.loads += self._ahead(m - 1, self.k + 1)
        return p


class Adaptive(Policy):
    """Cache-aware top-k (issue 16's probe, `benchmarks/variants_probe.py`: 0.68 of oracle on the
    default study, where commit reaches 0.48): a miss costs a load only for the pass's top-ranked
    expert of the layer (at batch 1, the token's top-1); a lower-ranked expert runs if it is
    already resident and is skipped otherwise. Prefill is exact, as for every policy."""
    name = "adaptive"
    skips = True

    def plan(self, m, needed, predicted_next):
        if not self.decode:
            return self.exact_plan(m, needed)
        keep = [e for i, e in enumerate(needed) if i == 0 or self.pool.resident(m, e)]
        p = self.exact_plan(m, keep)
        p.skipped = [e for e in needed if e not in keep]
        return p


class AdaptiveAhead(Ahead, Adaptive):
    """adaptive, looking `depth` layers ahead (`cmoe.policy.ahead`)."""
    name = "adaptive-ahead"
    uses_prediction = True

    def begin_pass(self, decode, pred0, ahead=None):
        self.decode = decode
        self._reset()
        return self._prefetch(0, ahead) if decode else []

    def plan(self, m, needed, predicted_next, ahead=None):
        if self.decode:
            self._ran(m)
        p = super().plan(m, needed, predicted_next)
        if self.decode:
            p.loads += self._prefetch(m + 1, ahead)
        return p


class CommitAhead(Ahead, Commit):
    """commit, looking `depth` layers ahead (`cmoe.policy.ahead`)."""
    name = "commit-ahead"

    def begin_pass(self, decode, pred0, ahead=None):
        self._reset()
        loads = super().begin_pass(decode, pred0)
        return loads + self._prefetch(1, (ahead or [])[1:]) if decode else loads

    def plan(self, m, needed, predicted_next, ahead=None) -> LayerPlan:
        if self.decode:
            self._ran(m)
            if predicted_next is not None:
                self.wanted[m + 1].update(predicted_next)
        p = super().plan(m, needed, predicted_next)
        if self.decode:
            p.loads += self._prefetch(m + 2, (ahead or [])[1:])
        return p


_CLASSES = {c.name: c for c in (Upper, OnDemand, LruPrefetch, LfuFallback, Static, Commit, Oracle, Adaptive,
                                AdaptiveAhead, CommitAhead)}


def needs_predictions(name: str) -> bool:
    """Does the policy read next-layer predictions (a trace without them cannot drive it)?"""
    return name in _CLASSES and _CLASSES[name].uses_prediction


def trait(name: str, what: str) -> bool:
    """A policy's trait (holds_all, cpu_experts, commits, skips, uses_prediction, uses_future) by name."""
    return name in _CLASSES and bool(getattr(_CLASSES[name], what))


def any_trait(names, what: str) -> bool:
    """Does any of the policies `names` have the trait (`trait`)?"""
    return any(trait(n, what) for n in names)


def python_step(name: str, program: bool = True) -> bool:
    """Does the executor plan this policy's layers in its Python step (`HardwareProfile.python_step`'s
    host costs)? Every built-in policy that plans has a compiled twin, which the host program runs
    (the CPU-expert ones handing their CPU work back to Python a layer), so only where the program is
    off (`program`: `CMOE_HOST_PROGRAM` not "0"); `upper` has no host step to plan either way."""
    return not program and name in _CLASSES and not trait(name, "holds_all")


def depth_of(name: str) -> int:
    """How many layers of predictions the policy reads (1: the next layer's only)."""
    return _CLASSES[name].depth if name in _CLASSES else 1


def needs_future(name: str) -> bool:
    """Does the policy read the routing's future (only a replayed trace has one)?"""
    return name in _CLASSES and _CLASSES[name].uses_future


def make_policy(name: str, layout: PoolLayout, num_experts: int, popularity: list[list[int]],
                future: list | None = None) -> Policy:
    """`future`: per pass, per MoE layer, the experts needed (the replayed passes' `needed`), for
    the policies that read it (oracle); None where the routing is live."""
    from cmoe.core.errors import CmoeError
    if name not in _CLASSES:
        raise CmoeError(f"unknown policy '{name}': choose from {', '.join(POLICIES)}")
    if needs_future(name) and future is None:
        raise CmoeError(f"policy {name} reads the routing's future, which only a replayed trace has: pass --trace")
    return _CLASSES[name](layout, num_experts, popularity, future)
