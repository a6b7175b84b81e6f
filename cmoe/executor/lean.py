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
import time

import numpy as np
import torch

from cmoe.executor.engine import Engine, PlanRecord, _slot_table
from cmoe.executor.lean_steps import HostSteps, owa_device
from cmoe.core.metrics import classify
from cmoe.trace.passes import ranked


class _Capture:
    """Stands in for the engine behind each experts shim: keeps the layer's MLP input and routing
    (tensors on the device) and returns zeros, so the MoE block's own forward computes its shared
    part alone (0 + shared is exact) and the routed part is added after, by X_m."""

    def __init__(self, sink: dict):
        self.sink = sink
        self.zeros: dict = {}                      # read only: the MoE blocks add to it, never into it

    def moe_layer(self, m, hidden, idx, weights):
        self.sink["x"][m], self.sink["idx"][m], self.sink["w"][m] = hidden, idx, weights
        key = (hidden.shape, hidden.dtype, hidden.device)
        z = self.zeros.get(key)                    # one zero tensor per shape: no memset per layer
        if z is None:
            z = self.zeros[key] = torch.zeros_like(hidden)
        return z


class LeanEngine(HostSteps, Engine):
    def __init__(self, model, shims, spec, store, policy, device, record_plans=False, owa=True, lead_us=0.0,
                 graphs: bool | None = None):
        super().__init__(model, shims, spec, store, policy, device, record_plans, owa, lead_us, hooks=False)
        self.layers = model.model.layers
        self.fused = store.packing == "tiled"
        self.use_graphs = self.cuda if graphs is None else (graphs and self.cuda)
        self.upper = policy.holds_all
        self.silent = self.upper and self.fused          # no host step between A_m and X_m
        self.has_cpu = policy.cpu_experts
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
        self.kin = None
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
        self._norms = []
        if self.cuda and os.environ.get("CMOE_FUSED_NORM", "1") != "0":
            from cmoe.executor.kernels_triton.norm import fuse_norms
            self._norms = fuse_norms(model)
        from cmoe.executor import attention
        self._attn = attention.install(model, spec.family, self.cuda)
        self._steps = self.cuda and os.environ.get("CMOE_FUSED_STEPS", "1") != "0"
        if self._steps:                                    # router top-k and X_m's sum in one launch each
            from cmoe.executor.kernels_triton.steps import fuse_routers
            self._norms += fuse_routers(model)
        self.has_shared = spec.shared_ffn > 0               # else the MoE block's output is the routed sum
        self._books: list = []
        self.host_phases = {} if os.environ.get("CMOE_HOST_PROFILE") == "1" else None
        self._t_phase = 0.0
        self._fused: list = []                             # one launch's marks, split per expert when resolved                             # passes whose bookkeeping waits for the next launch
        self._upper_marks: list = []
        self._in_graph = False                             # warm-up and capture: no spans
        self._static_out = False
        self.t_graph = None

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

    # --- segments: device work only (eager, or recorded into a graph) ----------------------------
    def _decoder(self, d: int, h: torch.Tensor) -> torch.Tensor:
        io = self.io
        out = self.layers[d](h, attention_mask=io["mask"], position_ids=io["pos"], past_key_values=self.kv,
                             position_embeddings=self.t["pe"])
        return out[0] if isinstance(out, tuple) else out

    def _predict(self, m: int, src: torch.Tensor) -> None:
        """MoE layer m's router on an earlier hidden state. Eager, its host time is a `host_predict`
        span; inside a graph it costs the host nothing (its GPU time lies in `attention`)."""
        h0 = self.clock.host()
        self._predicting = True
        try:
            _, w, idx = self.gates[m](src.reshape(-1, src.shape[-1]))
        finally:
            self._predicting = False
        self.t["pred"][m] = (idx, w)
        if not self._in_graph:
            self._span(self.spec.moe_layers[m], "host", "host_predict", -1, h0, self.clock.host())

    def seg_pre(self) -> None:
        t, io = self.t, self.io
        h = self.model.model.embed_tokens(io["ids"])
        t["pe"] = self.model.model.rotary_emb(h, io["pos"])
        for d in self._dense_before[0]:
            h = self._decoder(d, h)
        t["h_in0"] = h
        if self.commit and self.cur.decode:
            if self.spec.moe_layers[0] == 0:                # the source is layer 0's input norm
                t["src0"] = self.layers[0].input_layernorm(h)
            self._predict(0, t["src0"])

    def seg_attn(self, m: int) -> None:
        t = self.t
        h = t["h_in0"] if m == 0 else t["h"][m - 1]
        for d in self._dense_before[m] if m else ():
            h = self._decoder(d, h)
        self._decoder(self.spec.moe_layers[m], h)           # hooks keep mid, x, routing, shared
        if self.policy.uses_prediction and m + 1 < self.M:
            self._predict(m + 1, t["x"][m])
        if not self.silent:
            t["rb"][m] = torch.cat(self._readback_parts(m), 1)

    def _readback_parts(self, m: int) -> list:
        t = self.t
        parts = [t["idx"][m].float(), t["w"][m].float()]
        if self.commit and self.cur.decode:
            parts.append(t["logits"][m].float().reshape(parts[0].shape[0], -1))
        if self.policy.uses_prediction and m + 1 < self.M:
            parts += [t["pred"][m + 1][0].float(), t["pred"][m + 1][1].float()]
        return parts

    def _kernel(self, m: int, table: torch.Tensor, out_dtype=None) -> torch.Tensor:
        """The routed experts of layer m from the slots `table` points at, in x's dtype (or
        out_dtype: fp32 for a wave's partial sum, rounded once when the waves are added)."""
        from cmoe.executor.moe_kernel import moe_forward
        t, k = self.t, self.kin
        x = t["x"][m]
        if k.get("owa"):                                  # commit in decode: OWA on the device
            ids, w = owa_device(t["logits"][m], k["ids"][m], k["comm"][m], self.spec.top_k, self.spec.renormalize,
                                self.spec.scaling, self.spec.scoring == "sigmoid")
        elif k["host_ids"]:
            ids, w = k["ids"][m], k["w"][m]
        else:                                              # the router's own choice, on the device
            ids, w = t["idx"][m].to(torch.int32), t["w"][m].float()
        return moe_forward(x, ids, w, table, self.pool.blocks[m], self.store.layout, workspace=self._ws,
                           out_dtype=out_dtype)

    def seg_experts(self, m: int, y: torch.Tensor | None = None) -> None:
        """X_m: the layer's routed experts (or `y`, computed already) plus the residual. Written
        into the same tensor every time, the next segment's input."""
        t = self.t
        mid, shared = t["mid"][m], t["shared"][m]
        if y is None and self._steps and self.fused:        # one launch: the cast, the sums, the copy
            from cmoe.executor.kernels_triton.steps import residual_sum
            acc = self._kernel(m, self.table[m], out_dtype=torch.float32)
            dst = t["h"][m] if self._static_out and t["h"][m] is not None else None
            t["h"][m] = residual_sum(mid, acc.view(mid.shape), shared if self.has_shared else None, dst)
            return
        if y is None:
            y = self._kernel(m, self.table[m])
        y = y.view(shared.shape).to(shared.dtype)
        out = mid + (shared + y) if self.has_shared else mid + y
        if self._static_out and t["h"][m] is not None:
            t["h"][m].copy_(out)
        else:
            t["h"][m] = out

    def _wave_add(self, m: int) -> None:
        """One launch wave of layer m under a graph: the experts the table row names, added in
        fp32 to the layer's running sum (the eager path's order: 0 + wave 1 + wave 2 ...)."""
        self._wave_acc.add_(self._kernel(m, self.table[m], torch.float32))

    def _wave_finish(self, m: int) -> None:
        """After layer m's last wave: the sum rounded once, the residual, and the sum zeroed."""
        self.seg_experts(m, self._wave_acc.to(self.t["x"][m].dtype))
        self._wave_acc.zero_()

    def seg_head(self) -> None:
        t = self.t
        h = t["h"][self.M - 1]
        for d in self._dense_after:
            h = self._decoder(d, h)
        h = self.model.model.norm(h)
        t["logits_out"] = self.model.lm_head(h[:, -1])
        if self.silent:                                    # upper's bookkeeping: every layer's choice
            t["all_idx"] = torch.stack([torch.cat([t["idx"][m].float(), t["w"][m].float()], 1)
                                        for m in range(self.M)])

    # --- graphs ----------------------------------------------------------------------------------
    def _capture(self, B: int) -> None:
        """Warm up and record the decode segments, over the static inputs (first decode pass)."""
        h0 = time.perf_counter()
        dev = self.device
        E = self.spec.num_experts
        self.io = {"ids": torch.zeros((B, 1), dtype=torch.long, device=dev),
                   "pos": torch.zeros((B, 1), dtype=torch.long, device=dev), "mask": self.kv.decode_mask}
        self._make_kin(B, decode=True)
        if self.fused:
            from cmoe.executor.kernels_triton import Workspace
            self._ws = Workspace(B, self._kin_k, self.spec.hidden, self.spec.expert_ffn, E, dev)
        self.kv.aim_decode()                             # warm-up writes where this pass will write
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        self.t = _fresh(self.M)
        self._cap.sink = self.t
        self._static_out = False
        self._in_graph = True
        with torch.cuda.stream(side), torch.no_grad():    # warm-up: compiles kernels, sizes buffers
            for _ in range(2):
                self._program_eager()
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.t = _fresh(self.M)
        self._cap.sink = self.t
        pool = torch.cuda.graph_pool_handle()
        g = {}

        def rec(name, fn, *a):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, pool=pool), torch.no_grad():
                fn(*a)
            g[name] = gr

        waves = self.fused and not self.has_cpu and not self.silent and not self.commit \
            and os.environ.get("CMOE_WAVE_GRAPHS", "1") != "0"
        if waves:                                          # a layer in launch waves: one replay a wave
            self._wave_acc = torch.zeros((B, self.spec.hidden), dtype=torch.float32, device=dev)
        rec("pre", self.seg_pre)
        for m in range(self.M):
            rec(("attn", m), self.seg_attn, m)
            if self.fused and not self.has_cpu:
                rec(("experts", m), self.seg_experts, m)
            else:                                          # eager experts write into this buffer
                self.t["h"][m] = torch.empty_like(self.t["mid"][m])
            if waves:
                rec(("wave", m), self._wave_add, m)
                self._static_out = True                    # finish writes X_m's own output tensor
                rec(("finish", m), self._wave_finish, m)
                self._static_out = False
        rec("head", self.seg_head)
        torch.cuda.synchronize(dev)
        self.graphs = g
        self.t_graph = self.t
        self._static_out = True
        self._in_graph = False
        self.log.capture_us = (time.perf_counter() - h0) * 1e6

    def _program_eager(self) -> None:
        self.seg_pre()
        for m in range(self.M):
            self.seg_attn(m)
            if self.fused:
                self.seg_experts(m)
            else:
                self.t["h"][m] = self.t["mid"][m] + self.t["shared"][m]
        self.seg_head()

    def _make_kin(self, N: int, decode: bool) -> None:
        """Kernel inputs the host writes: ids and weights when they are not the router's (replay,
        or commit in decode), the slot-table staging in pinned memory."""
        dev, M = self.device, self.M
        host_ids = self.cur.replay is not None or (self.commit and decode)
        K = self.spec.top_k
        self._kin_k = K
        k = {"host_ids": host_ids, "N": N}
        if host_ids:
            k["ids"] = torch.full((M, N, K), -1, dtype=torch.int32, device=dev)
            k["w"] = torch.zeros((M, N, K), dtype=torch.float32, device=dev)
            pin = self.cuda
            k["ids_h"] = torch.full((M, N, K), -1, dtype=torch.int32, pin_memory=pin)
            k["w_h"] = torch.zeros((M, N, K), dtype=torch.float32, pin_memory=pin)
        E = self.spec.num_experts
        waves = min(N * K, E) + 1                          # a layer never runs in more launches
        k["table_h"] = torch.from_numpy(self._table_host) if not self.cuda else \
            torch.empty((M, waves, E), dtype=torch.int32, pin_memory=True)
        k["table_np"] = k["table_h"].numpy()
        if host_ids:
            k["ids_np"], k["w_np"] = k["ids_h"].numpy(), k["w_h"].numpy()
        if self.commit and decode and self.fused and self.owa:
            # each row's committed candidates (host) and the committed set (host); weights on the device
            k["owa"] = True
            k["comm"] = torch.zeros((M, self.spec.num_experts), dtype=torch.bool, device=dev)
            k["comm_h"] = torch.zeros((M, self.spec.num_experts), dtype=torch.bool, pin_memory=self.cuda)
            k["comm_np"] = k["comm_h"].numpy()
        self.kin = k
        self._rb_pin = [None] * M

    # --- a pass ----------------------------------------------------------------------------------
    def run_pass(self, p, cache) -> torch.Tensor:
        self.cur = p
        self.kv = cache
        if p.index == 0:
            _check_window(self.model.config, cache.max_len)
        self.token_pred = [None] * self.M
        self.token_pred_w = [None] * self.M
        B, n = p.input_ids.shape
        graphs = self.use_graphs and p.decode and n == 1
        if graphs and self.graphs is None:
            self._settle()
            self._capture(B)
            self._prev_end = None                          # capture is not a pass's time
        cs = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self._lead_cycles:
                torch.cuda._sleep(self._lead_cycles)
        self.h_last = self.clock.host()
        start = self.clock.mark(cs)
        self.last = start
        with torch.no_grad():
            self._inputs(p, graphs)
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
            self._begin_pass(self.t["pred"][0])
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
        end = self.clock.mark(cs)
        self._span(-1, "compute", "head", -1, self.last, end)
        self._span(-1, "host", "host_head", -1, self.h_last, self.clock.host())
        logits = self.t["logits_out"]
        books = self._keep_books(p, start, end)
        self._settle()                                     # the previous pass's, while the GPU runs this one
        self._books.append(books)
        if self.cuda:
            cs.synchronize()
        self.log.occupancy.append(self.policy.pool.occupancy())
        return logits.clone() if graphs else logits

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
                copied.record()
        marks, self._upper_marks = self._upper_marks, []
        return (p, start, end, idx, marks, copied)

    def _settle(self) -> None:
        """Bookkeeping of finished passes: pass times, upper's plans and counts, span marks."""
        for p, start, end, idx, marks, copied in self._books:
            if self.cuda:
                end.synchronize()
                if copied is not None:
                    copied.synchronize()
            if self.silent:
                self._upper_books(p, idx, marks)
            us = self.clock.us(end) - (self._prev_end if self._prev_end is not None else self.clock.us(start))
            self._prev_end = self.clock.us(end)
            self.log.pass_us.append((p.index, p.decode, int(p.active.sum()), us))
        self._books = []
        self._resolve(final=False)

    def finish(self):
        self._settle()
        self.log.host_phases = self.host_phases
        self.log.plans.sort(key=lambda r: (r.pass_index, r.layer))   # upper's are settled a pass late
        return super().finish()

    def _inputs(self, p, graphs: bool) -> None:
        B, n = p.input_ids.shape
        if graphs:
            self.kv.step()
            self.io["ids"].copy_(p.input_ids, non_blocking=True)
            self.io["pos"].copy_(p.position_ids, non_blocking=True)
        else:
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
        k = self.kin
        if self.fused and k["host_ids"] and p.replay is not None and not (self.commit and p.decode):
            # a replayed trace's routes for every layer: one copy for the pass
            ex, wt = p.replay["experts"], p.replay["weights"]       # [N, M, K]
            k["ids_h"].copy_(torch.from_numpy(np.ascontiguousarray(ex.transpose(1, 0, 2)).astype(np.int32)))
            k["w_h"].copy_(torch.from_numpy(np.ascontiguousarray(wt.transpose(1, 0, 2)).astype(np.float32)))
            k["ids"].copy_(k["ids_h"], non_blocking=True)
            k["w"].copy_(k["w_h"], non_blocking=True)

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
                self.log.spans.append((self.source, p, d, "compute", "expert", e, a + j * step,
                                       b if j == len(experts) - 1 else a + (j + 1) * step, nbytes))
        self._fused = keep
        super()._resolve(final)

    def close(self) -> None:
        super().close()
        if self._norms:
            from cmoe.executor.kernels_triton.norm import unfuse
            unfuse(self._norms)
            self._norms = []
        if self._attn:
            from cmoe.executor import attention
            attention.uninstall(self._attn)
            self._attn = []
        self.graphs = None
        self.t = self.t_graph = self.kin = self.io = self._ws = self._wave_acc = None
        self._rb_pin = []
        self._cap.sink = {}


def _check_window(config, max_len: int) -> None:
    """The static cache's mask attends to the whole context; a model that attends within a sliding
    window shorter than the run's context would be computed wrongly, so it is refused."""
    from cmoe.core.errors import CmoeError
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and max_len > window:
        raise CmoeError(f"this model attends within a sliding window of {window} tokens and the run needs "
                        f"{max_len}: use --engine hf, or fewer --tokens")


def _fresh(M: int) -> dict:
    return {"x": [None] * M, "idx": [None] * M, "w": [None] * M, "logits": [None] * M, "mid": [None] * M,
            "shared": [None] * M, "pred": [None] * M, "rb": [None] * M, "h": [None] * M}


def _expert_to_slot(where: dict, E: int) -> list[int]:
    t = [-1] * E
    for e, s in where.items():
        t[e] = s
    return t
