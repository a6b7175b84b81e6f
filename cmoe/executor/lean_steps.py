"""The host's step of the lean engine between a layer's attention segment (A_m) and its experts
segment (X_m): the read-back, the policy's plan, the loads, the slot table and the launches
(`_host_layer`); commit's no-wait step (`_commit_layer`); and what they share. A mixin of
`cmoe.executor.lean.LeanEngine`, apart so that "how the executor runs a layer's experts" reads in
one file; the step's copies between host and device are in `lean_io`."""

from __future__ import annotations

import os
import time

import torch

from cmoe.executor.few_experts import twin
from cmoe.executor.lean_io import HostIO
from cmoe.executor.records import PlanRecord, _loads, _slot_table
from cmoe.policy.waves import waves as launch_waves


def host_profile() -> str | None:
    """`CMOE_HOST_PROFILE`: "1" (the Python step by phase; the compiled program off), "pass" (the
    graphed passes and their boundary by phase, the program running) or None (no profile)."""
    v = os.environ.get("CMOE_HOST_PROFILE")
    return v if v in ("1", "pass") else None


class HostSteps(HostIO):
    def _host_layer(self, m: int, graphs: bool) -> None:
        """Layer m's step between A_m and X_m: the policy's plan from the read-back, its loads,
        the launches (one, or one per wave), then the CPU experts and the residual if any."""
        if self.kin is not None and self.kin.get("owa") and self.cur.decode:
            return self._commit_layer(m, graphs)
        if not self.fused:                                 # the per-expert loop of the reference engine
            return self._loop_layer(m, graphs)
        d, clock, cs, h_in, t_in = self._enter_layer(m)
        if self.silent:
            self._run_x(m, graphs)
            t1 = clock.mark(cs)
            self._upper_marks.append((m, t_in, t_in, t1))
            self.last, self.h_last = t1, clock.host()
            return
        st = self._plan_layer(m, d, h_in, graphs)
        if self._lead_cycles:
            torch.cuda._sleep(self._lead_cycles)
        t_plan = clock.mark(cs)
        self._tick("spans, mark")
        self._span(d, "compute", "route", -1, t_in, t_plan)
        y = self._launch_waves(m, d, st, t_plan, graphs)
        if st["wave_graphs"]:
            if st["cpu"]:                                  # the waves' fp32 sum, then the CPU experts'
                self._wave_acc.add_(self._cpu_sum(m, d, st))
            self.graphs[("finish", m)].replay()
        elif not st["one_launch"]:
            if y is None:
                y = torch.zeros(self.t["x"][m].shape, dtype=torch.float32, device=self.device)
            if st["cpu"]:
                y = y + self._cpu_sum(m, d, st)
            self.seg_experts(m, y.to(self.t["x"][m].dtype))
        if self.record_plans:
            self._record_plan(m, st["needed"], st["predicted"], st["plan"], st["plan"].cpu)
        # one launch: nothing is queued on the compute stream after its end mark, which already
        # marks where the layer's work ends (as silent's and commit's layers use theirs)
        self.last = st["end"] if st["one_launch"] else clock.mark(cs)
        self.h_last = clock.host()

    def _cpu_sum(self, m: int, d: int, st: dict) -> torch.Tensor:
        """The layer's CPU experts, summed on the host once its GPU launches are queued (fp32, on
        the device); how long the host took after the GPU's part was queued is kept."""
        gpu_done = self.clock.mark(self.cs)
        back = self._cpu_acc(m, d, st["cpu"], st["assign"], st["x_host"])
        self._cpu_waits.append((self.cur.index, gpu_done, self.clock.host()))
        return back

    def _input_to_host(self, m: int, d: int) -> torch.Tensor:
        """Layer m's input taken to the host for its CPU experts (the round trip's first half)."""
        h0 = self.clock.host()
        x = self.t["x"][m].to("cpu")
        self._span(d, "cpu", "roundtrip", -1, h0, self.clock.host(), x.numel() * x.element_size())
        return x

    def _cpu_step(self, m: int, phase: int) -> int:
        """A CPU-expert layer's CPU part, which the compiled host program calls back for
        (`host_program._layer`): phase 0, after the plan and its loads, takes the layer's input to
        the host (`_plan_layer`'s); phase 1, after the waves' launches, assigns the CPU experts' rows
        and adds their sum to the waves' (`_host_layer`'s). The experts are the twin's (its step
        1 + m), their rows the read-back's as the Python step assigns them; spans, fallbacks and
        the host's wait are kept as it keeps them. 0, or 1 with the exception kept for `_hp_pass`
        (none crosses C frames).

        Why the rows are assigned after the launches: assigned before them (c6d297e, as the Python
        step does), the H100 runs of the twenty-ninth session took 5-97 us longer from a CPU layer's
        route to its first CPU expert than the twenty-eighth session's with them after, in all six
        rows at batch 1: the route step that follows the read-back's wait grew by 30-70 us, and the
        set-up after the launches shrank by 24 us at most. Python run right after a wait runs cold
        (`host_wake`)."""
        try:
            d = self.spec.moe_layers[m]
            if phase == 0:
                self._hp_x = self._input_to_host(m, d)
                return 0
            dec, K, live = self._hp["d"], self.spec.top_k, self._live()
            cpu = dec.c_e[dec.c_ptr[1 + m]:dec.n[1]].tolist()
            pin = self._rb_pin[m]                           # the program's read-back landed there
            host = pin[4] if pin is not None else self.t["rb"][m].numpy()
            rows, wsorted, scores, _, _ = self._parse_routes(m, host, K, 0, live)
            assign = self._assign(m, None, rows, wsorted, scores, live, K)
            self.log.at(self.cur.index).fallbacks += len(cpu)
            x, self._hp_x = self._hp_x, None
            self._wave_acc.add_(self._cpu_sum(m, d, {"cpu": [e for e in cpu if e in assign], "assign": assign, "x_host": x}))
            return 0
        except BaseException as exc:                      # noqa: BLE001 (raised again after the pass)
            self._hp_error = exc
            return 1

    def _loop_layer(self, m: int, graphs: bool) -> None:
        """Experts in another format than the tiled int4: the reference engine's per-expert loop."""
        t = self.t
        self.logits = t["logits"]
        self.pred_gpu = t["pred"]
        x, idx, w = t["x"][m], t["idx"][m], t["w"][m]
        y = self.moe_layer(m, x, idx, w)
        h = t["mid"][m] + (t["shared"][m] + y.view(t["shared"][m].shape))
        if graphs:
            t["h"][m].copy_(h)
        else:
            t["h"][m] = h

    def _plan_layer(self, m: int, d: int, h_in: float, graphs: bool) -> dict:
        """The read-back, the same `plan` call as the simulator, each expert's rows, the loads
        issued (those into a slot this layer still reads deferred to after its wave), the waves,
        and the CPU experts' input taken to the host. Returns what the launches need."""
        clock = self.clock
        live = self._live()
        self._tick(None)
        host = self._read_back(m)
        self._tick("read-back wait")
        self.h_synced = clock.host()
        K = self.spec.top_k
        K2 = self.t["pred"][m + 1][0].shape[1] if self.policy.uses_prediction and m + 1 < self.M else 0
        rows, wsorted, scores, needed, predicted = self._parse_routes(m, host, K, K2, live)
        self._tick("parse routes")
        self._span(d, "host", "host_sync", -1, h_in, self.h_synced)
        plan = self.policy.plan(m, needed, predicted, **self._ahead(m + 1, live))
        self._tick("plan")
        assign = self._assign(m, plan, rows, wsorted, scores, live, K)
        self._tick("assign")
        gpu = [e for e in plan.gpu if e in assign]
        cpu = [e for e in plan.cpu if e in assign]
        loaded_now = {ld.expert for ld in plan.loads if ld.layer == m}
        later = self._issue(plan.loads, defer=set(plan.gpu))
        self._tick("issue loads")
        tally = self.log.at(self.cur.index)
        tally.fallbacks += len(plan.cpu)
        tally.skipped += len(plan.skipped)
        waves = _waves(gpu, later) or [[]]               # no GPU expert: one launch that skips all
        if self.commit and self.cur.decode:
            self._write_assignment(m, assign, len(rows))
        self._tick("write ids")
        x_host = self._input_to_host(m, d) if cpu and self.cuda else None
        self._span(d, "host", "host_route", -1, self.h_synced, clock.host())
        one_launch = len(waves) <= 1 and not cpu
        wave_graphs = not one_launch and graphs and ("wave", m) in self.graphs
        return {"plan": plan, "needed": needed, "predicted": predicted, "assign": assign, "cpu": cpu,
                "later": later, "loaded_now": loaded_now, "waves": waves, "x_host": x_host,
                "one_launch": one_launch, "wave_graphs": wave_graphs}

    def _launch_waves(self, m: int, d: int, st: dict, due, graphs: bool):
        """Each wave: its slot-table row, the waits on its slots' copies, its launch (the layer's
        graph, the wave graph, or an eager launch into an fp32 sum, returned), then the loads
        that waited for its reads."""
        clock, plan, later = self.clock, st["plan"], st["later"]
        cs = self.cs
        y = None
        for k, wave in enumerate(st["waves"]):
            h0 = clock.host()
            self._set_table(m, {e: plan.slots[e] for e in wave}, wave=k)
            for e in wave:
                s = plan.slots[e]
                assert self.pool.expert[m][s] == e, f"slot {s} of layer {m} holds {self.pool.expert[m][s]}, plan says {e}"
                landed = self._landed[(m, e)] if self.pool.pending[m][s] else None
                self._experts.append((self.cur.index, e in st["loaded_now"], landed, due, h0))
                self.pool.before_read(m, s)
            self._tick("table, waits")
            t0 = clock.mark(cs)
            self._tick("launch: marks")
            few = graphs and twin(len(wave), self._few_max)  # its few-expert graphs (`few_experts`)
            if st["one_launch"]:
                self._run_x(m, graphs, few)
            elif st["wave_graphs"]:
                self.graphs[("wave-few" if few else "wave", m)].replay()
            else:
                part = self._kernel(m, self.table[m], torch.float32)     # (the switch is the graphs' twins)
                y = part.clone() if y is None else y + part
            self._tick("launch: replay or kernel")
            t1 = due = st["end"] = clock.mark(cs)
            self._tick("launch: marks")
            self._fused_span(d, wave, t0, t1)
            self.pool.mark_read(m, [plan.slots[e] for e in wave], t1 if self.cuda else None)
            for ld in [x for x in later if x.victim in wave]:
                self._load(ld)
                later.remove(ld)
            self._span(d, "host", "host_expert", -1, h0, clock.host())
        for ld in later:
            self._load(ld)
        self._tick("after launch")
        return y

    def _enter_layer(self, m: int):
        """The host reaches layer m's step: the attention segment's spans end here.
        Returns (decoder layer, clock, compute stream, host time, mark)."""
        d, clock = self.spec.moe_layers[m], self.clock
        cs = self.cs
        self._layer = m
        h_in = clock.host()
        t_in = clock.mark(cs)
        self._span(d, "compute", "attention", -1, self.last, t_in)
        self._span(d, "host", "host_attention", -1, self.h_last, h_in)
        return d, clock, cs, h_in, t_in

    def _commit_layer(self, m: int, graphs: bool) -> None:
        """commit in decode: layer m's experts were committed at layer m-1, so its launch needs no
        read-back; each row's committed candidates go to the device and OWA weights them there from
        the router's live scores. The host then reads the layer back, while the experts run, and
        plans: the same `plan` call (its GPU set is the committed one), whose loads are layer m+1's."""
        d, clock, cs, h_in, t_in = self._enter_layer(m)
        self._tick(None)
        # the read-back first, right behind A_m: ahead of the kernel inputs' copies and of the
        # waits on this layer's slot copies, so its wait below ends with A_m, not with a late load
        started = self._read_back_start(m)
        chosen = list(self.policy.committed[m])
        K = self.spec.top_k
        live = self._live()
        self._write_candidates(m, chosen, live)
        slots = {e: self.policy.pool.slot_of(m, e) for e in chosen}
        self._set_table(m, slots, 0)
        self._tick("commit: read-back, ids, table")
        if self._lead_cycles:
            torch.cuda._sleep(self._lead_cycles)
        t_plan = clock.mark(cs)                            # before the waits: a late copy shows as a gap
        self._span(d, "compute", "route", -1, t_in, t_plan)
        h0 = clock.host()
        waited = False
        for e in chosen:
            s = slots[e]
            assert self.pool.expert[m][s] == e, f"slot {s} of layer {m} holds {self.pool.expert[m][s]}, commit says {e}"
            landed = self._landed[(m, e)] if self.pool.pending[m][s] else None
            self._experts.append((self.cur.index, False, landed, t_plan, h0))
            waited = self.pool.before_read(m, s) or waited
        # no wait queued: the launch starts at the plan's mark, the same stream position
        t0 = clock.mark(cs) if waited else t_plan
        self._tick("table, waits")
        self._run_x(m, graphs)
        self._tick("launch: replay or kernel")
        t1 = clock.mark(cs)
        self._fused_span(d, chosen, t0, t1)
        self.pool.mark_read(m, list(slots.values()), t1 if self.cuda else None)
        self._span(d, "host", "host_expert", -1, h0, clock.host())
        self._tick("launch: marks")
        h_rb = clock.host()
        host = self._read_back_wait(started)               # while the layer's experts run
        self._tick("read-back wait")
        self.h_synced = clock.host()
        self._span(d, "host", "host_sync", -1, h_rb, self.h_synced)
        K2 = self.t["pred"][m + 1][0].shape[1] if m + 1 < self.M else 0
        rows, wsorted, scores, needed, predicted = self._parse_routes(m, host, K, K2, live)
        self._tick("parse routes")
        plan = self.policy.plan(m, needed, predicted, **self._ahead(m + 1, live))
        assert plan.gpu == chosen, (plan.gpu, chosen)
        self._tick("plan")
        self._issue(plan.loads, defer=set())               # layer m+1's: no slot of this layer is touched
        self._tick("issue loads")
        self.log.at(self.cur.index).skipped += len(plan.skipped)
        if self.record_plans:
            self._record_plan(m, needed, predicted, plan, ())
        self._span(d, "host", "host_route", -1, self.h_synced, clock.host())
        self.last = t1
        self.h_last = clock.host()
        self._tick("after launch")

    def _record_plan(self, m: int, needed, predicted, plan, cpu) -> None:
        """Layer m's decision as `record_plans` keeps it: what it needed and predicted, its loads,
        where its experts ran (`cpu`: the CPU's), what it skipped, and the slots after it."""
        self.log.plans.append(PlanRecord(
            self.cur.index, m, tuple(needed), tuple(predicted) if predicted is not None else None,
            _loads(plan.loads), tuple(plan.gpu), tuple(cpu), tuple(plan.skipped), tuple(self.pool.expert[m]),
            tuple(_slot_table(self.policy.pool.where[m], len(self.pool.expert[m])))))

    def _tick(self, phase: str | None) -> None:
        """Host time by phase of the policy's step (`CMOE_HOST_PROFILE=1`; summed in `host_phases`),
        or with `CMOE_HOST_PROFILE=pass` of the graphed passes alone (`_hp_setup` drops what the
        prefill's Python step timed), the compiled host program running: its layers one phase, the
        boundary between passes what this times."""
        if self.host_phases is None:
            return
        now = time.perf_counter()
        if phase is not None:
            self.host_phases[phase] = self.host_phases.get(phase, 0.0) + (now - self._t_phase) * 1e6
            if phase in ("read-back wait", "pass: head"):
                count = "layers" if phase == "read-back wait" else "passes"
                self.host_phases[count] = self.host_phases.get(count, 0) + 1
        self._t_phase = now

    def _parse_routes(self, m, host, K, K2, live):
        """A replayed pass's routes come ready-made (`replay_rows.replay_rows`, built before the timed
        run: the same lists and rankings the reference engine derives per layer); only commit's
        router scores come from the read-back."""
        r = self.cur.replay
        if r is None or "needed" not in r or len(live) != len(self.cur.active):
            return super()._parse_routes(m, host, K, K2, live)
        rows, wsorted = r["lists"]["route"][0][m], r["lists"]["route"][1][m]
        scores = None
        if self.commit and self.cur.decode:
            scores = self._scores(host[:, 2 * K: 2 * K + self.spec.num_experts])
        predicted = None
        if K2:
            self._keep_prediction(m + 1, None, None)
            predicted = list(r["predicted"][m + 1])
        return rows, wsorted, scores, list(r["needed"][m]), predicted

    def _run_x(self, m: int, graphs: bool, few: bool = False) -> None:
        """X_m in one launch: its graph (`few`: its few-expert twin, which `_capture` made for every
        layer where it set `_few_max`), else eagerly."""
        key = ("experts-few" if few else "experts", m)
        if graphs and key in self.graphs:
            self.graphs[key].replay()
        else:
            self.seg_experts(m)

    def _cpu_acc(self, m, d, cpu, assign, x_host) -> torch.Tensor:
        """CPU experts of the layer, on the host, summed with their weights (fp32, host tensor)."""
        from cmoe.executor.kernels import ExpertViews, ffn
        clock = self.clock
        x = x_host if x_host is not None else self.t["x"][m]
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for e in cpu:
            r = torch.tensor([i for i, _ in assign[e]])
            wt = torch.tensor([w for _, w in assign[e]], dtype=torch.float32)
            h0 = clock.host()
            v = self._cpu_views.get((m, e))
            if v is None:
                v = self._cpu_views[(m, e)] = ExpertViews(self.store.layout, self.store.cpu_expert(m, e), "cpu")
            y = ffn(x.index_select(0, r), v, self.act).float()
            acc.index_add_(0, r, y * wt[:, None])
            self._span(d, "cpu", "cpu_expert", e, h0, clock.host(), self.store.slot)
        h0 = clock.host()
        back = acc.to(self.device)
        if self.cuda:
            self._span(d, "cpu", "roundtrip", -1, h0, clock.host(), acc.numel() * acc.element_size())
        return back


def owa_device(logits: torch.Tensor, ids: torch.Tensor, comm: torch.Tensor, top_k: int, renormalize: bool,
               scaling: float, sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`cmoe.policy.owa.owa_weights` for every row at once, on the device (graph-safe): ids [N, K]
    each row's committed candidates (-1: none; a row with none takes the committed expert its
    router scores highest), comm [E] the committed set. Returns (ids int32, weights fp32)."""
    s = torch.sigmoid(logits.float()) if sigmoid else torch.softmax(logits.float(), -1)
    ids = ids.long()
    none = (ids < 0).all(-1, keepdim=True)
    best = torch.where(comm[None, :], s, torch.full_like(s, -1.0)).argmax(-1, keepdim=True)
    first = torch.zeros_like(ids, dtype=torch.bool)
    first[:, 0] = True
    ids = torch.where(none & first, best, ids)
    valid = ids >= 0
    got = s.gather(1, ids.clamp(min=0)) * valid
    total = got.sum(-1, keepdim=True)
    mass = (torch.ones_like(total) if renormalize else s.topk(top_k, -1).values.sum(-1, keepdim=True)) * scaling
    even = valid * (mass / valid.sum(-1, keepdim=True).clamp(min=1))
    w = torch.where(total > 0, got / total.clamp(min=torch.finfo(torch.float32).tiny) * mass, even)
    return ids.to(torch.int32), w.contiguous()


def _waves(gpu: list[int], later: list) -> list[list[int]]:
    """The layer's GPU experts in launches (`cmoe.policy.waves`, which the simulator reads too);
    with no load deferred behind a launch, what it returns without being asked: one launch."""
    if not later:
        return [list(gpu)] if gpu else []
    return launch_waves(gpu, {ld.expert: ld.victim for ld in later})
