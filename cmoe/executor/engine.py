"""The executor's engine: runs a transformers model whose experts modules hand each MoE layer
to `Engine.moe_layer`, which asks the policy for a plan, issues the loads on the copy stream,
computes the planned experts from their slots (and fallbacks on the CPU) and records a timeline.

Per pass (a prefill or one decode step of the batch) and MoE layer m:
1. The router has run. Its choice (and, for `commit`, its logits and the prediction for layer
   m+1 made from layer m's MLP input) is read back to the host in one copy; that sync is what a
   real system pays too. In replay mode the trace's routes replace the live ones after the read.
2. `policy.plan(m, needed, predicted_next)`, the same call the simulator makes with the same
   arguments: `needed` is the union of the tokens' experts ranked by votes, as `trace.passes`
   ranks them. Loads go to the copy stream at once, except a load that overwrites an expert this
   layer still reads, which is issued right after that expert's kernel.
3. GPU experts run in plan order, each waiting only for its own slot's `ready` event; after each
   kernel the slot's `read` event is recorded, and a later load into that slot waits for it.
   CPU experts (lfu-fallback, static) take the hidden states to the host, run there while the
   GPU works, and come back.
4. `commit` in decode: each token computes its own predicted experts that were committed, with
   OWA weights from its true router scores (`cmoe.policy.owa`); routed experts not committed
   are skipped. Prefill is exact, as in the simulator.

Compute-stream spans: `attention` (everything from the previous MoE layer's experts to this
router's read-back: norms, attention, shared experts, dense layers), `route` (read-back and
planning, while the GPU idles), `expert`, and `head` (final norm and LM head). Copy-stream
spans: `load`. Host spans: `cpu_expert`, `roundtrip`.

The `host` lane says where the Python thread spent its time, on the same clock: `host_attention`
(issuing everything between two MoE layers), `host_sync` (waiting at the read-back for the GPU to
catch up), `host_route` (reading the routes, planning, issuing loads), `host_expert` (issuing one
expert's kernels and the loads deferred behind it) and `host_head`; `host_predict` (running the
next layer's router early, labelled with the layer it predicts) lies inside a `host_attention`. When the GPU runs ahead of
the host these host spans are what the compute spans measure; when the GPU is behind (waiting for
a load) the host runs ahead and the two differ: the simulator models both (`cmoe.sim.engine`).
`lead_us` (calibration only) queues that much GPU sleep before each layer's experts and before
each pass, so the host gets ahead and the compute spans measure the GPU's own time.

Hits, stalls and loads are counted by `cmoe.core.metrics`'s rules, shared with the simulator: each
GPU expert's marks (when its pending copy landed, when the stream and the host reached its
kernel) are kept until they resolve, then `metrics.classify` says hit, late or demand.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cmoe.executor.kernels import ffn
from cmoe.executor.records import PassInput, PlanRecord, RunLog, _loads, _slot_table
from cmoe.executor.routes import Routes
from cmoe.executor.streams import Clock, DevicePool, sleep_cycles
from cmoe.core.metrics import classify
from cmoe.core.timeline import STREAM, START, END, Span
from cmoe.policy.policies import Policy
from cmoe.core.spec import ModelSpec
from cmoe.trace.hf import prediction_source
from cmoe.trace.passes import ranked

DENSE_ROWS = 16          # up to this many rows, every expert runs on all rows (weights 0 for the rest)


class Engine(Routes):
    spans_each_pass = True               # its marks read after every pass (the lean engine on CUDA: at finish)

    def __init__(self, model, shims, spec: ModelSpec, store, policy: Policy, device: torch.device,
                 record_plans: bool = False, owa: bool = True, lead_us: float = 0.0, hooks: bool = True):
        self.model, self.spec, self.store, self.policy, self.device = model, spec, store, policy, device
        self.cuda = device.type == "cuda"
        self.source = "gpu" if self.cuda else "cpu"
        if self.cuda:
            # cuDNN's attention builds a plan for every new sequence length: measured on the H200,
            # ~40 ms the first time each KV length is met (once per pass in decode), which made
            # whichever policy ran first look ~1.8x slower. Flash/efficient kernels need no plans.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.M = spec.num_moe_layers
        self.clock = Clock(device)                     # on CUDA: the runtime's events, or torch's without it
        self.pool = DevicePool(policy.layout, store.layout, device, views=store.packing != "tiled", rt=self.clock.rt)
        self.cs = self.pool.compute                    # the compute stream, looked up once a pass (run_pass)
        self.record_plans = record_plans
        self.log = RunLog()
        self.act = F.silu
        self.commit = policy.commits
        self.owa = owa                                 # commit: re-weight with OWA, or keep the prediction's weights
        layers = model.model.layers
        self.gates = [layers[d].mlp.gate for d in spec.moe_layers]
        if hooks:
            for s in shims:
                s.engine = self
        self._pending: list = []                     # spans whose marks are not resolved yet
        self._experts: list = []                     # (pass, own load, landed mark, due mark, host issue us)
        self._cpu_waits: list = []                   # (pass, GPU done mark, host us when CPU results return)
        self._landed: dict = {}                      # (layer, expert) -> end mark of its latest load
        self._srcs: dict = {}                        # (layer, expert) -> its row of the store (`_load`)
        self._prev_end: float | None = None
        self._cpu_views: dict = {}
        self._predicting = False
        self._lead_cycles = sleep_cycles(lead_us, device) if lead_us and self.cuda else 0
        # the current pass (set by run_pass and the per-layer steps)
        self.cur: PassInput | None = None            # the pass being run
        self.begun = False                           # its layer-0 prediction and first loads are out
        self._layer = -1                             # the MoE layer whose step runs now
        self.last = self.h_last = None               # GPU mark and host time where the last layer's work ended
        self.h_synced = 0.0                          # host time the last read-back finished
        self.logits: list = [None] * self.M          # per MoE layer: router logits on the device (commit)
        self.pred_gpu: list = [None] * self.M        # per MoE layer: the early router's choice on the device
        self.deep: list = [None] * self.M            # per MoE layer q: [(idx, w)] of layers q.. from q's source
        self.token_pred: list = [None] * self.M      # per MoE layer: each token's predicted experts
        self.token_pred_w: list = [None] * self.M    # ... and their weights (commit without OWA)
        self.handles = []
        for m in range(self.M if hooks else 0):
            self.handles.append(self.gates[m].register_forward_hook(self._on_gate(m)))
            self.handles.append(self._source(m).register_forward_hook(self._on_source(m)))
        self._warm()

    # --- setup ----------------------------------------------------------------------------
    def _source(self, m: int):
        return prediction_source(self.model.model.layers, self.spec, m)

    def _warm(self) -> None:
        """Copy the policy's warm residents into their slots (untimed, as after a warm-up)."""
        for m, where in enumerate(self.policy.pool.where):
            for e, s in where.items():
                self.pool.raw[m][s].copy_(self.store.expert(m, e)[: self.pool.raw[m][s].numel()])
                self.pool.expert[m][s] = e
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def prepare(self, passes) -> None:
        """Before timing, given every PassInput of a replay: nothing to stage here (the lean engine
        puts the replayed routes on the device)."""

    def close(self) -> None:
        self._rb_ahead = None                          # the last read-back `_ahead` read (a pinned view)
        for h in self.handles:
            h.remove()
        for s in self.model.modules():
            if hasattr(s, "engine"):
                s.engine = None

    # --- hooks ----------------------------------------------------------------------------
    def _on_gate(self, m: int):
        def hook(_mod, _inp, out):
            if not self._predicting:
                self.logits[m] = out[0]
        return hook

    def _on_source(self, m: int):
        def hook(_mod, _inp, out):
            h = out.reshape(-1, out.shape[-1])
            decode_first = (self.commit or self.policy.depth > 1) and self.cur.decode
            if self.policy.uses_prediction and (m > 0 or decode_first):
                h0 = self.clock.host()
                self.deep[m] = self._early_routers(m, h)
                self.pred_gpu[m] = self.deep[m][0]
                self._span(self.spec.moe_layers[m], "host", "host_predict", -1, h0, self.clock.host())
            if m == 0:
                self._begin_pass()
        return hook

    def _begin_pass(self, pred=None, host=None) -> None:
        """The policy's loads at the start of the pass (commit: from the layer-0 prediction, `pred`
        or the one the hooks kept, or already on the host as [ids, weights] rows: `host`)."""
        pred0: list[int] = []
        if self.commit and self.cur.decode:
            idx, w = pred if pred is not None else self.pred_gpu[0]
            host = torch.cat([idx.float(), w.float()], 1).cpu().numpy() if host is None else host
            K = idx.shape[1]
            rows = self._keep_prediction(0, host[:, :K], host[:, K:])
            pred0 = list(ranked([r for r, a in zip(rows, self.cur.active) if a])[0])
        self._layer = -1
        loads = self.policy.begin_pass(self.cur.decode, pred0, **self._ahead(0, self._live()))
        self._issue(loads, defer=set())
        if self.record_plans:
            self.log.plans.append(PlanRecord(self.cur.index, -1, (), tuple(pred0), _loads(loads), (), (), (), (), ()))
        self.begun = True

    # --- loads ----------------------------------------------------------------------------
    def _issue(self, loads, defer: set[int]) -> list:
        later = []
        for ld in loads:
            if ld.layer == self._layer and ld.victim in defer:
                later.append(ld)
                continue
            self._load(ld)
        return later

    def _load(self, ld) -> None:
        key = (ld.layer, ld.expert)
        src = self._srcs.get(key)                    # the store's row, a view made once (indexing ~1 us)
        if src is None:
            src = self._srcs[key] = self.store.expert(ld.layer, ld.expert)
        t0, t1 = self.pool.load(ld.layer, ld.slot, ld.expert, src, self.clock)
        self._span(self.spec.moe_layers[ld.layer], "copy0", "load", ld.expert, t0, t1, self.pool.expert_nbytes)
        self._landed[key] = t1
        self.log.loaded(self.cur.index, self.pool.expert_nbytes)

    # --- the MoE layer --------------------------------------------------------------------
    def moe_layer(self, m: int, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Layer m's experts on `hidden` [N, H]: read back and plan, issue the loads, run the GPU
        experts in plan order (each after its own slot's copy), then the CPU ones; [N, H] out."""
        assert self.begun, "the pass began without the layer-0 prediction hook firing"
        d, clock = self.spec.moe_layers[m], self.clock
        self._layer = m
        cs = self.cs
        h_in = clock.host()
        t_in = clock.mark(cs)
        self._span(d, "compute", "attention", -1, self.last, t_in)
        self._span(d, "host", "host_attention", -1, self.h_last, h_in)
        st = self._plan_experts(m, d, hidden, idx, weights, h_in)
        out = torch.zeros_like(hidden)
        x_host = None
        if st["cpu"] and self.cuda:                # hidden states to the host before the GPU gets busy
            h0 = clock.host()
            x_host = hidden.to("cpu")
            self._span(d, "cpu", "roundtrip", -1, h0, clock.host(), x_host.numel() * x_host.element_size())
        if self._lead_cycles:
            torch.cuda._sleep(self._lead_cycles)
        t_plan = clock.mark(cs)
        self._span(d, "compute", "route", -1, t_in, t_plan)
        self._gpu_experts(m, d, hidden, out, st, t_plan)
        if st["cpu"]:
            gpu_done = clock.mark(cs)
            self._cpu_experts(m, d, st["cpu"], st["order"], st["wmat"], hidden, x_host, out)
            self._cpu_waits.append((self.cur.index, gpu_done, clock.host()))
        if self.record_plans:
            plan, pool = st["plan"], self.pool
            self.log.plans.append(PlanRecord(
                self.cur.index, m, tuple(st["needed"]), tuple(st["predicted"]) if st["predicted"] is not None else None,
                _loads(plan.loads), tuple(plan.gpu), tuple(plan.cpu), tuple(plan.skipped), tuple(pool.expert[m]),
                tuple(_slot_table(self.policy.pool.where[m], len(pool.expert[m])))))
        self.last = clock.mark(cs)
        self.h_last = clock.host()
        return out

    def _plan_experts(self, m, d, hidden, idx, weights, h_in) -> dict:
        """The read-back, the plan, each expert's row weights ([experts, N], on the device too),
        and the loads issued (those into a slot this layer still reads deferred)."""
        live = self._live()
        rows, wsorted, scores, needed, predicted = self._read_routes(m, idx, weights, live)
        self._span(d, "host", "host_sync", -1, h_in, self.h_synced)
        plan = self.policy.plan(m, needed, predicted, **self._ahead(m + 1, live))
        assign = self._assign(m, plan, rows, wsorted, scores, live, idx.shape[1])
        gpu = [e for e in plan.gpu if e in assign]
        cpu = [e for e in plan.cpu if e in assign]
        order = gpu + cpu
        N = hidden.shape[0]
        wmat = np.zeros((len(order), N), np.float32)
        for j, e in enumerate(order):
            for i, w in assign[e]:
                wmat[j, i] = w
        dense = N <= DENSE_ROWS
        st = {"plan": plan, "needed": needed, "predicted": predicted, "gpu": gpu, "cpu": cpu, "order": order,
              "wmat": wmat, "wdev": torch.from_numpy(wmat).to(self.device), "dense": dense,
              "rows_dev": {} if dense else {e: torch.tensor([i for i, _ in assign[e]]).to(self.device) for e in order},
              "loaded_now": {ld.expert for ld in plan.loads if ld.layer == m}}
        st["later"] = self._issue(plan.loads, defer=set(plan.gpu))
        tally = self.log.at(self.cur.index)
        tally.fallbacks += len(plan.cpu)
        tally.skipped += len(plan.skipped)
        self._span(d, "host", "host_route", -1, self.h_synced, self.clock.host())
        return st

    def _gpu_experts(self, m, d, hidden, out, st, due) -> None:
        """The planned GPU experts in order, into `out`; after each, the loads waiting for its slot."""
        pool, clock, plan, later = self.pool, self.clock, st["plan"], st["later"]
        cs = self.cs
        for j, e in enumerate(st["gpu"]):
            s = plan.slots[e]
            assert pool.expert[m][s] == e, f"slot {s} of layer {m} holds {pool.expert[m][s]}, plan says {e}"
            h0 = clock.host()
            landed = self._landed[(m, e)] if pool.pending[m][s] else None
            self._experts.append((self.cur.index, e in st["loaded_now"], landed, due, h0))
            pool.before_read(m, s)
            t0 = clock.mark(cs)
            if st["dense"]:
                out.add_(ffn(hidden, pool.views[m][s], self.act) * st["wdev"][j][:, None].to(out.dtype))
            else:
                r = st["rows_dev"][e]
                y = ffn(hidden.index_select(0, r), pool.views[m][s], self.act)
                out.index_add_(0, r, y * st["wdev"][j].index_select(0, r)[:, None].to(out.dtype))
            t1 = due = clock.mark(cs)
            pool.after_read(m, s)
            self._span(d, "compute", "expert", e, t0, t1, pool.raw[m][s].numel())
            for ld in [x for x in later if x.victim == e]:     # the slot's earlier expert has been read
                self._load(ld)
                later.remove(ld)
            self._span(d, "host", "host_expert", e, h0, clock.host())
        for ld in later:                 # victims that were not computed (no rows): issue now
            self._load(ld)

    def _span(self, layer, stream, op, expert, a, b, nbytes=0) -> None:
        self._pending.append((self.cur.index, layer, stream, op, expert, a, b, nbytes))

    def _resolve(self, final: bool) -> None:
        """Turn marks into microseconds once both ends have happened (all of them at the end)."""
        keep = []
        for sp in self._pending:
            p, layer, stream, op, expert, a, b, nbytes = sp
            if not final and not (self.clock.done(a) and self.clock.done(b)):
                keep.append(sp)
                continue
            self.log.spans.append(Span(self.source, p, layer, stream, op, expert, self.clock.us(a), self.clock.us(b), nbytes))
        self._pending = keep
        c = self.clock
        keep = []
        for x in self._experts:
            p, own, landed, due, h0 = x
            if not final and not (c.done(due) and (landed is None or c.done(landed))):
                keep.append(x)
                continue
            self.log.ran(p, *classify(own, None if landed is None else c.us(landed), max(c.us(due), h0)))
        self._experts = keep
        keep = []
        for x in self._cpu_waits:
            p, gpu_done, back = x
            if not final and not c.done(gpu_done):
                keep.append(x)
                continue
            self.log.at(p).stall_us += max(0.0, back - c.us(gpu_done))
        self._cpu_waits = keep

    # --- passes ---------------------------------------------------------------------------
    def _compute_stream(self):
        """The stream this pass's kernels run on, looked up once (torch's lookup costs ~4.7 us on
        the H200's host, and a layer's step would make it several times): kept for the layer
        steps (`self.cs`) and for the pool's waits and read marks."""
        if not self.cuda:
            return None
        self.cs = self.pool.use_compute(torch.cuda.current_stream(self.device))
        return self.cs

    def run_pass(self, p: PassInput, cache) -> torch.Tensor:
        """One forward pass; returns the last position's logits [B, V] (on the device)."""
        self.cur = p
        self.begun = False
        self.logits = [None] * self.M
        self.pred_gpu = [None] * self.M
        self.deep = [None] * self.M
        self.token_pred = [None] * self.M
        self.token_pred_w = [None] * self.M
        cs = self._compute_stream()
        if self.cuda:
            # Start every pass from an idle device: copies still running from the previous pass
            # finish first (that wait counts, see below).
            torch.cuda.synchronize(self.device)
            if self._lead_cycles:
                torch.cuda._sleep(self._lead_cycles)
        self.h_last = self.clock.host()
        start = self.clock.mark(cs)
        self.last = start
        with torch.no_grad():
            out = self.model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        end = self.clock.mark(cs)
        self._span(-1, "compute", "head", -1, self.last, end)
        self._span(-1, "host", "host_head", -1, self.h_last, self.clock.host())
        logits = out.logits[:, -1]
        if self.cuda:
            cs.synchronize()
        # a pass lasts from the end of the previous one (so waits between passes count) to its end
        us = self.clock.us(end) - (self._prev_end if self._prev_end is not None else self.clock.us(start))
        self._prev_end = self.clock.us(end)
        self.log.pass_us.append((p.index, p.decode, int(p.active.sum()), us))
        self.log.occupancy.append(self.policy.pool.occupancy())
        self._resolve(final=False)
        return logits

    def check_slots(self) -> int:
        """Slots whose device bytes differ from the host bytes of the expert the policy says is there."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        bad = 0
        for m, where in enumerate(self.policy.pool.where):
            for e, s in where.items():
                raw = self.pool.raw[m][s]
                bad += self.pool.expert[m][s] != e or not torch.equal(raw.cpu(), self.store.expert(m, e)[: raw.numel()])
        return bad

    def finish(self) -> RunLog:
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self._resolve(final=True)
            self.log.host_calls, self.log.late_events = self.clock.calls, self.clock.late
        finally:
            self.release()
        self.log.spans.sort(key=lambda s: (s[START], s[END], s[STREAM]))
        return self.log

    def release(self) -> None:
        """The run's device events destroyed: after `finish`, or after a run that raised (the
        events would otherwise outlive it in the process's CUDA context). Twice does nothing."""
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)
        finally:
            try:
                self.pool.settle()
            finally:
                self.clock.close()

