"""The lean engine: the executor's default. It drives the decoder itself, layer by layer, over a
static KV cache, so a decode step is a short fixed program the host replays instead of a Python
forward it re-issues.

Why transformers' own modules, called piece by piece, rather than model code of our own: one code
path then serves all six families (RoPE variants, QK norms, MLA, shared experts, dense first
layers) as their authors wrote them, and its logits are checked against the unmodified model.
What the model code costs on the GPU under graphs is measured in BENCHMARKS.md; the host no
longer pays for it, which is what held the old engine back (~1 ms of Python per layer).

A pass is this program (M MoE layers; d_m the decoder layer of MoE layer m):

    P      embeddings, rotary tables, the dense layers before d_0 (and, for commit's decode, the
           layer-0 prediction)
    A_m    the dense layers after d_{m-1}, then d_m up to its router: input norm, attention with
           the cache, residual, post-attention norm, router, shared experts, and the router of
           MoE layer m+1 applied to this layer's MLP input (the prediction, for policies that
           use one); then one [rows, columns] read-back buffer of what the host may need
    (host) the policy's step: the read-back, plan, loads, the slot table
    X_m    the routed experts of layer m in one launch (`cmoe.executor.moe_kernel.moe_forward`,
           weights found through the device-side expert -> slot table), and the residual sum
    H      the dense layers after the last MoE layer, the final norm, the LM head

In decode on CUDA each segment is a CUDA graph over static buffers, captured once per run (the
batch is fixed, so one bucket) on the first decode pass and replayed after; capture's cost is
timed (`RunLog.capture_us`) and kept out of the passes' times. Between A_m and X_m the host does
only what the policy needs: `upper` needs nothing (its experts' slots never change, and the
kernel reads the router's choice on the device), so its decode step runs with no host wait and
its bookkeeping happens after the pass; every other policy reads the layer's routes back once
(a non-blocking copy into pinned memory, then a wait on its event), plans with the same call
the simulator makes, issues its loads on the copy stream (a copy waits for its slot's last
reader, the kernel waits for the copy), and writes the slot table row, a small host-to-device
copy on the compute stream. `commit` in decode needs no wait before its experts: layer m's were
committed at layer m-1, so the host writes each row's committed candidates, X_m weights them by
OWA on the device from the router's live scores (`owa_device`), and only then does the host read
the layer back and plan, while the experts run (its loads are layer m+1's).

How a layer's experts run depends on the store's packing: int4 experts in the tiled layout
("fused": one launch per layer; Triton on CUDA, `moe_reference` on the CPU) or any other format
through the reference engine's per-expert loop (`Engine.moe_layer`, host-synchronous, eager).
A layer whose plan loads an expert into a slot another expert of the same layer still reads
(the batch needs more experts than the block has slots) runs in waves: the launch for the
first wave, the deferred copy, the launch for the next; so do layers with CPU experts
(`lfu-fallback`, `static`), whose results are added on the device before the residual. Under
graphs a wave is one replay of the layer's wave graph (the launch, added into an fp32 sum) and
a finish graph rounds the sum and adds the residual, instead of ~5 eager launches and two
element-wise ops a wave (`CMOE_WAVE_GRAPHS=0` keeps them eager).

Spans keep the reference engine's names and meanings (`cmoe.executor.engine`), with one
difference: a fused launch's time is split evenly among the experts it ran, in plan order, so
the timeline keeps one `expert` span per expert.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from cmoe.executor.engine import Engine
from cmoe.executor.kv import check_window
from cmoe.executor.lean_io import pass_inputs
from cmoe.executor.records import PlanRecord, _expert_to_slot, _slot_table
from cmoe.executor.lean_program import Segments, _Capture, _fresh, queues_passes
from cmoe.executor.replay_rows import routes_on_device
from cmoe.executor.lean_steps import HostSteps, host_profile
from cmoe.executor.lean_fast import HostProgramSteps
from cmoe.core.metrics import classify
from cmoe.core.timeline import Span
from cmoe.trace.passes import ranked


class LeanEngine(HostSteps, HostProgramSteps, Segments, Engine):
    def __init__(self, model, shims, spec, store, policy, device, record_plans=False, owa=True, lead_us=0.0,
                 graphs: bool | None = None):
        super().__init__(model, shims, spec, store, policy, device, record_plans, owa, lead_us, hooks=False)
        self.layers = model.model.layers
        self.fused = store.packing == "tiled"
        self.use_graphs = self.cuda if graphs is None else (graphs and self.cuda)
        self.upper = policy.holds_all
        self.silent = self.upper and self.fused          # no host step between A_m and X_m
        self.has_cpu = policy.cpu_experts
        self.spans_each_pass = not self.cuda               # on CUDA a run's spans are resolved at finish
        self.t: dict = _fresh(self.M)
        self._cap = _Capture(self.t)
        for s in shims:
            s.engine = self._cap
        d = spec.moe_layers
        for m in range(self.M):
            self.handles.append(self.layers[d[m]].post_attention_layernorm.register_forward_pre_hook(self._on_mid(m)))
            self.handles.append(self.layers[d[m]].mlp.register_forward_hook(self._on_shared(m)))
            self.handles.append(self.gates[m].register_forward_hook(self._on_logits(m)))
        self.handles.append(self._source(0).register_forward_hook(self._on_src0))
        self.graphs = None
        self.kin = None                                    # kernel inputs the host writes (`_make_kin`)
        self._kin_k = 0
        self._rb_pin: list = []                            # per MoE layer: the read-back's (pinned buffer, event)
        self.io: dict | None = None                        # the pass's inputs: ids, positions, mask
        self.kv = None                                     # the run's StaticKV
        self.log.capture_us = None
        self._dense_before = [list(range(0, d[0]))] + [list(range(d[m - 1] + 1, d[m])) for m in range(1, self.M)]
        self._dense_after = list(range(d[-1] + 1, spec.num_layers))
        E = spec.num_experts
        self._table_host = np.full((self.M, E), -1, np.int32)
        self.table = torch.full((self.M, E), -1, dtype=torch.int32, device=device)
        if self.upper:                                     # every expert resident, never moved
            for m in range(self.M):
                self.table[m] = torch.tensor(_expert_to_slot(policy.pool.where[m], E), dtype=torch.int32)
        self._ws = None
        self._wave_acc = None                              # graphs: a layer's fp32 sum over its waves
        self._fuse(model, spec.family)
        self.has_shared = spec.shared_ffn > 0               # else the MoE block's output is the routed sum
        self._books: list = []                             # passes whose bookkeeping waits for the next launch
        self.host_phases = {} if host_profile() else None   # `_tick`
        self._t_phase = 0.0
        self._fused: list = []                             # one launch's marks, split per expert when resolved
        self._upper_marks: list = []
        self._in_graph = False                             # warm-up and capture: no spans
        self._static_out = False
        self.t_graph = None
        # passes queued back to back (docs/executor.md); GPU-sleep runs and CMOE_PASS_SYNC=1 keep syncs
        self._overlap = queues_passes(self.cuda) and not self._lead_cycles
        self._chained, self._slot_src, self._rb_pin0 = False, None, None   # `pass_inputs`' table; `_read_back_pred0`'s
        self._stepped = self._rt_inputs = False            # P's graph steps the cache; inputs by runtime calls (`_capture`)
        self._spin = os.environ.get("CMOE_WAIT", "sync") == "spin"     # `HostIO._read_back_wait`: the A/B

    # --- hooks (record tensors; run inside graph capture too) ------------------------------------
    def _on_mid(self, m):
        def hook(_mod, args):
            self.t["mid"][m] = args[0]
        return hook

    def _on_shared(self, m):
        def hook(_mod, _inp, out):
            self.t["shared"][m] = out
        return hook

    def _on_logits(self, m):
        def hook(_mod, _inp, out):
            if not self._predicting:
                self.t["logits"][m] = out[0]
        return hook

    def _on_src0(self, _mod, _inp, out):
        self.t["src0"] = out

    def _make_kin(self, N: int, decode: bool) -> None:
        """Kernel inputs the host writes: ids and weights when they are not the router's (replay,
        or commit in decode), the slot-table staging in pinned memory."""
        dev, M = self.device, self.M
        host_ids = self.cur.replay is not None or (self.commit and decode)
        K = self._kin_k = self.spec.top_k
        k = {"host_ids": host_ids, "N": N}
        if host_ids:
            k["ids"] = torch.full((M, N, K), -1, dtype=torch.int32, device=dev)
            k["w"] = torch.zeros((M, N, K), dtype=torch.float32, device=dev)
        if self.commit and decode:                          # the host writes them per layer (a replay's: `prepare`)
            k["ids_h"] = torch.full((M, N, K), -1, dtype=torch.int32, pin_memory=self.cuda)
            k["w_h"] = torch.zeros((M, N, K), dtype=torch.float32, pin_memory=self.cuda)
            k["ids_np"], k["w_np"] = k["ids_h"].numpy(), k["w_h"].numpy()
        E = self.spec.num_experts
        waves = min(N * K, E) + 1                          # a layer never runs in more launches
        k["table_h"] = torch.from_numpy(self._table_host) if not self.cuda else \
            torch.empty((M, waves, E), dtype=torch.int32, pin_memory=True)
        k["table_np"] = k["table_h"].numpy()
        if self.cuda:                                      # per-layer views made once: indexing a tensor
            k["rows"], k["stage"] = list(self.table), [list(r) for r in k["table_h"]]   # costs ~2-5 us
        if self.commit and decode and self.fused and self.owa:
            # each row's committed candidates (host) and the committed set (host); weights on the device
            k["owa"] = True
            k["comm"] = torch.zeros((M, self.spec.num_experts), dtype=torch.bool, device=dev)
            k["comm_h"] = torch.zeros((M, self.spec.num_experts), dtype=torch.bool, pin_memory=self.cuda)
            k["comm_np"] = k["comm_h"].numpy()
        k.update({a + "_m": list(k[a]) for a in ("ids", "w", "ids_h", "w_h", "comm", "comm_h") if a in k})
        self.kin = k
        self._rb_pin = self._rb_pin if len(self._rb_pin) == M else [None] * M   # kept: a buffer per shape

    # --- a pass ----------------------------------------------------------------------------------
    def run_pass(self, p, cache) -> torch.Tensor:
        """One pass; returns the last position's logits [B, V] on the device: a graphed pass's static
        buffer, which the next pass's head overwrites in stream order (`run_policy` copies to keep)."""
        if self.host_phases is not None and self._t_phase:
            self._tick("between passes")             # the caller's time since the last pass returned
        self.cur = p
        self.kv = cache
        if p.index == 0:
            check_window(self.model.config, cache.max_len)
        self.token_pred = [None] * self.M
        self.token_pred_w = [None] * self.M
        B, n = p.input_ids.shape
        graphs = self.use_graphs and p.decode and n == 1
        if graphs and self.graphs is None:
            self._settle()
            self._capture(B)
            self._hp_setup()                               # the compiled host program, where it may run
            self._prev_end = None                          # capture is not a pass's time
        cs = self._compute_stream()
        chained = graphs and self._chained                 # queued behind the last pass: no wait for it
        if self.cuda and not chained:
            torch.cuda.synchronize(self.device)
            if self._lead_cycles:
                torch.cuda._sleep(self._lead_cycles)
        self.h_last = self.clock.host()
        start = self.clock.mark(cs)
        self.last = start
        with torch.no_grad():
            self._segments(p, graphs)
        end = self.clock.mark(cs)
        self._span(-1, "compute", "head", -1, self.last, end)
        self._span(-1, "host", "host_head", -1, self.h_last, self.clock.host())
        logits = self.t["logits_out"]
        self._tick("pass: head")
        books = self._keep_books(p, start, end)
        self._settle(self.spans_each_pass)                 # the previous pass's, while the GPU runs this one
        self._books.append(books)
        self._tick("pass: books, settle")
        self._chained = graphs and self._overlap
        if self.cuda and not self._chained:
            cs.synchronize()
        self._tick("pass: sync")
        self.log.occupancy.append(self._hp_occupancy() if graphs and self._hp else self.policy.pool.occupancy())
        # not copied (a torch op, ~15-30 us of the H200's host at the boundary, where the GPU waits)
        self._tick("pass: occupancy")
        return logits

    def _segments(self, p, graphs: bool) -> None:
        """The pass's device program: P, then each layer's A_m and the host's step for it, then H;
        replayed graphs on a captured decode pass, the segments run eagerly otherwise."""
        self._tick(None)
        self._inputs(p, graphs)
        self._tick("pass: inputs")
        if graphs and self._hp is not None:                # P, the layers and H by the compiled program
            return self._hp_pass(p)
        if graphs:
            self.t = self.t_graph
            self._cap.sink = self.t
            self._in_graph = True                      # replays: the hooks do not run
            self.graphs["pre"].replay()
        else:
            self.t = _fresh(self.M)
            self._cap.sink = self.t
            self._static_out = False
            self._in_graph = False
            self.seg_pre()
        self._begin_pass(self.t["pred"][0], self._pred0_host())
        self._tick("pass: pre, begin")
        for m in range(self.M):
            if graphs:
                self.graphs[("attn", m)].replay()
            else:
                self.seg_attn(m)
            self._host_layer(m, graphs)
        if graphs:
            self.graphs["head"].replay()
        else:
            self.seg_head()

    def _keep_books(self, p, start, end):
        """What settling this pass needs later: its marks, and (upper, live) a pinned copy of every
        layer's routing, taken on the stream after the head."""
        idx = copied = None
        if self.silent and p.replay is None:
            src = self.t["all_idx"]
            idx = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.cuda)
            idx.copy_(src, non_blocking=True)
            if self.cuda:
                copied = torch.cuda.Event()
                copied.record(self.cs)
        marks, self._upper_marks = self._upper_marks, []
        return (p, start, end, idx, marks, copied)

    def _settle(self, spans: bool = True) -> None:
        """Bookkeeping of finished passes: pass times, upper's plans and counts, and with `spans` the
        span marks. On CUDA a pass leaves the marks to `finish`: turning ~12 us of event queries and
        reads per span into microseconds after the head took a read-back policy's host 1.7-5.5 ms a
        pass, which the GPU spent idle before the next pass (the fourth H200 validation)."""
        for p, start, end, idx, marks, copied in self._books:
            if self.cuda:
                self.clock.wait(end)
                if copied is not None:
                    copied.synchronize()
            if self.silent:
                self._upper_books(p, idx, marks)
            us = self.clock.us(end) - (self._prev_end if self._prev_end is not None else self.clock.us(start))
            self._prev_end = self.clock.us(end)
            self.log.pass_us.append((p.index, p.decode, int(p.active.sum()), us))
        self._books = []
        if spans:
            self._resolve(final=False)

    def finish(self):
        self._hp_finish()
        self._settle()
        if self._stepped and self.kv is not None:
            self.kv.check_device_steps()
        self.log.host_phases = self.host_phases
        self.log.plans.sort(key=lambda r: (r.pass_index, r.layer))   # upper's are settled a pass late
        return super().finish()

    def _inputs(self, p, graphs: bool) -> None:
        B, n = p.input_ids.shape
        if graphs:                                         # runtime calls where it can (`pass_inputs`)
            pairs = [(self.io["ids"], p.input_ids), (self.io["pos"], p.position_ids)] + self._route_pairs(p)
            pass_inputs(self.clock.rt if self._rt_inputs else None, self.kv, pairs, self.pool.compute_h,
                        self._slot_src, self._stepped)
            return
        if self.graphs is not None:
            # the eager path replaces the inputs and workspace the graphs were captured over
            raise RuntimeError("an eager pass after the decode graphs were captured: one engine serves "
                               "one prefill and its decode steps")
        if p.decode:
            self.kv.step()
            mask = self.kv.decode_mask
        else:
            mask = self.kv.prefill(n, p.attention_mask)
        self.io = {"ids": p.input_ids, "pos": p.position_ids, "mask": mask}
        if self.fused:
            self._make_kin(B * n, p.decode)
            self._ws = None
        for d, s in self._route_pairs(p):
            d.copy_(s, non_blocking=True)

    def _route_pairs(self, p) -> list:
        """A replayed trace's routes for every layer, (destination, source): one copy each for the
        pass, from the device where `prepare` put them before timing (a caller that skipped it
        pays the upload here)."""
        if not self._reads_routes(p):
            return []
        if "device" not in p.replay:
            routes_on_device(p.replay, self.device)
        ids, wt = p.replay["device"]
        return [(self.kin["ids"], ids), (self.kin["w"], wt)]

    def _reads_routes(self, p) -> bool:                    # the replayed trace's, not the router's or commit's
        return self.fused and p.replay is not None and not (self.commit and p.decode)

    def prepare(self, passes) -> None:
        """Before timing: the replayed routes of every pass that reads them, on the device; the
        passes' needs as the compiled host program's twin reads them."""
        self._hp_prepare(passes)
        for p in passes:
            if self._reads_routes(p):
                routes_on_device(p.replay, self.device)

    # --- spans and upper's bookkeeping -----------------------------------------------------------
    def _fused_span(self, d: int, experts: list[int], t0, t1) -> None:
        """One launch for `experts`: resolved into one `expert` span each, the time split evenly."""
        if experts:
            self._fused.append((self.cur.index, d, tuple(experts), t0, t1, self.store.slot))

    def _upper_books(self, p, idx, marks) -> None:
        """upper after its pass: each layer's routing (the trace's, or the router's, read back once
        for the whole pass) through the same `plan` call, every expert a hit."""
        live = [i for i in range(len(p.active)) if p.active[i]]
        if p.replay is None:
            allidx = idx.numpy()
            K = allidx.shape[2] // 2
        for m, t_in, t0, t1 in marks:
            if p.replay is not None:
                rows = [[int(e) for e in r if e >= 0] for r in p.replay["experts"][:, m]]
            else:                                          # by weight, as the reference engine ranks them
                rows, _ = self._ranked_rows(allidx[m][:, :K], allidx[m][:, K:], m, "route")
            needed = list(ranked([rows[i] for i in live])[0])
            plan = self.policy.plan(m, needed, None)
            d = self.spec.moe_layers[m]
            self._pending.append((p.index, d, "compute", "route", -1, t_in, t0, 0))
            if plan.gpu:
                self._fused.append((p.index, d, tuple(plan.gpu), t0, t1, self.store.slot))
            for _ in plan.gpu:
                self.log.ran(p.index, *classify(False, None, 0.0))
            if self.record_plans:
                self.log.plans.append(PlanRecord(p.index, m, tuple(needed), None, (), tuple(plan.gpu), (), (),
                                                 tuple(self.pool.expert[m]),
                                                 tuple(_slot_table(self.policy.pool.where[m], len(self.pool.expert[m])))))

    def _resolve(self, final: bool) -> None:
        keep = []
        for sp in self._fused:
            p, d, experts, t0, t1, nbytes = sp
            if not final and not (self.clock.done(t0) and self.clock.done(t1)):
                keep.append(sp)
                continue
            a, b = self.clock.us(t0), self.clock.us(t1)
            step = (b - a) / len(experts)
            for j, e in enumerate(experts):
                self.log.spans.append(Span(self.source, p, d, "compute", "expert", e, a + j * step,
                                       b if j == len(experts) - 1 else a + (j + 1) * step, nbytes))
        self._fused = keep
        super()._resolve(final)

    def close(self) -> None:
        try:
            if self._chained:                              # the last pass was queued: let it end first
                torch.cuda.synchronize(self.device)
        finally:
            self._chained = False
            super().close()
            self._drop_program()
