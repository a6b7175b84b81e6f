"""The lean engine's graphed decode passes through the compiled host program
(`cmoe.executor.host_program`): when a run may use it (`_hp_setup`), how a pass calls it
(`_hp_pass`), and at the run's end its records as the engine's spans and tallies, the
policy object's state written back from its compiled twin (`_hp_finish`). A mixin of
`cmoe.executor.lean.LeanEngine`.

Where it runs: graphed decode passes on CUDA with the runtime found, with the fused layer kernel;
of a replayed trace for the policies whose plan is exact or skips (`ondemand`, `lru-prefetch`,
`oracle`, `adaptive`, `commit` in its own order, and the look-ahead `adaptive-ahead` and
`commit-ahead`, their deeper predictions from the replay's `seen`; the CPU-expert ones calling back
for their CPU work, `HostSteps._cpu_step`), and of a live run (no trace)
for those that plan from the read-backs alone (`ondemand`, `lru-prefetch`, `adaptive`, `commit`:
`host_live` ranks each read-back as `routes._parse_routes` does, and commit's candidates are each
row's prediction by weight, as `_keep_prediction` keeps them). Elsewhere, and with
CMOE_HOST_PROGRAM=0 (the A/B), the Python step runs as before: `upper` (no host step to speed up),
the CPU-expert and look-ahead policies live, the host-phase profiler (`CMOE_HOST_PROFILE=1`; `=pass`
times the pass's boundary with the program running) and the GPU-sleep calibration runs. Recorded plans (`record_plans`) are rebuilt from the twin's decisions and the program's
per-layer snapshots of the slots. The twin decides from the pass's routes as the replay engine does
(a replay's ranked needs and predictions from the trace, which the Python step reads too; a live
pass's from the read-back), after the layer's read-back wait, so causality is the Python step's:
nothing of layer m is decided before its routes exist.
"""

from __future__ import annotations

import weakref

import numpy as np

from cmoe.executor import host_program as hp
from cmoe.executor.cuda_rt import Mark
from cmoe.executor.host_live import layout, live_pass
from cmoe.executor.lean_steps import host_profile
from cmoe.core.util import host_program_on

FAST_KINDS = ("ondemand", "lru-prefetch", "oracle", "adaptive", "commit", "adaptive-ahead", "commit-ahead",
              "lfu-fallback", "static")
LIVE_KINDS = ("ondemand", "lru-prefetch", "adaptive", "commit")   # those that plan from the read-backs alone


def replay_arrays(passes, M: int, rows: bool, depth: int = 1) -> tuple:
    """The engine's replayed passes as the twin reads them: each pass's ranked needs and
    predictions (a `PassArrays`, whose other fields the twin does not read), with `depth` > 1 the
    predictions by distance a look-ahead policy reads, and with `rows` each row's predictions
    [P, M, N, Kp] (commit's candidates are chosen from them). (None, None) unless every pass is a
    replay whose rows are all live, indexed from 0 (what the Python step's replay path reads).

    Distances: the Python step hands layer q's plan `seen[q][:depth]` (what the state predicting
    layer q says of layers q, q+1, ...); the twin reads layer j's prediction at distance k + 1 at
    (p, j, k), which is `seen[j - k][k]`. Entries with j < k no plan reaches: left empty."""
    from cmoe.trace.pass_arrays import PassArrays, csr
    P = len(passes)
    if not passes or [p.index for p in passes] != list(range(P)) or \
            any(p.replay is None or "needed" not in p.replay or not p.active.all() for p in passes) or \
            (depth > 1 and any("seen" not in p.replay for p in passes)):
        return None, None
    (nptr, need), (pptr, pred) = (csr([p.replay[key][m] for p in passes for m in range(M)], np.int16)
                                  for key in ("needed", "predicted"))
    D = 1 if depth == 1 else min(depth, max(len(x) for p in passes for x in p.replay["seen"]))
    aptr, ahead = (pptr, pred) if D == 1 else csr(
        [p.replay["seen"][j - k][k] if j >= k else [] for p in passes for j in range(M) for k in range(D)], np.int16)
    z = np.zeros(P, np.int64)
    pa = PassArrays(decode=np.array([p.decode for p in passes], bool), ntok=z, context=z, keys=z,
                    tok_ptr=np.zeros(P + 1, np.int64), tok=np.zeros(0, np.int64), need_ptr=nptr, need=need,
                    votes=np.zeros(need.size, np.int32), pred_ptr=pptr, pred=pred, num_layers=M, ahead_ptr=aptr,
                    ahead=ahead, depth=D)
    if not rows:
        return pa, None
    shapes = [np.shape(p.replay["pred"]) for p in passes]
    tp = np.full((P, M, max(x[0] for x in shapes), max(x[2] for x in shapes)), -1, np.int16)
    for p in passes:
        r = np.asarray(p.replay["pred"])
        tp[p.index, :, :r.shape[0], :r.shape[2]] = r.transpose(1, 0, 2)
    return pa, tp


class HostProgramSteps:
    _hp = _hp_pa = _hp_tp = _hp_rbh = _hp_cb = _hp_x = _hp_error = None
    _hp_live = False

    def _hp_allowed(self) -> bool:
        """The run's configuration allows the program (its passes and buffers are checked later)."""
        return (host_program_on() and self.cuda and self.clock.rt is not None
                and self.fused and not self.silent and (self.owa or not self.commit)
                and self.policy.name in FAST_KINDS
                and (self.policy.depth > 1 or not self.policy.name.endswith("-ahead"))   # depth 1: `_ahead` hands none
                and not self._lead_cycles and hp.perf_counter_is_monotonic()
                and (self.host_phases is None or host_profile() == "pass"))

    def _hp_live_run(self) -> bool:
        """On the first graphed decode pass, with no replay's arrays: the run is live (no trace), its
        rows all real, its policy one that plans from the read-backs alone (a live look-ahead reads
        deeper columns: the Python step)."""
        return self._hp_pa is None and self.cur.replay is None and self.cur.active.all() \
            and self.policy.name in LIVE_KINDS and self.policy.depth == 1

    def _hp_prepare(self, passes) -> None:
        """Before timing, where the program may run: the passes as its twin reads them."""
        self._hp_pa = self._hp_tp = None
        self._hp_live = False
        if self._hp_allowed():
            self._hp_pa, self._hp_tp = replay_arrays(passes, self.M, rows=self.commit, depth=self.policy.depth)

    def _hp_setup(self) -> None:
        """Right after capture (the device synchronised, untimed): the program's arrays, the twin's
        state exported from the policy object, the program compiled for them (its first build on a
        machine takes seconds, later processes load it from numba's cache: counted in `capture_us`,
        the first request's cost); or None where anything it needs is missing."""
        self._hp = None
        if self.host_phases is not None and host_profile() == "pass":
            self.host_phases.clear()                       # the graphed passes alone: not the prefill's Python step
        if not self._hp_allowed():
            return
        if self._hp_live_run():                            # every pass planned from its read-backs (`host_live`)
            self._hp_pa, self._hp_live = live_pass(self.M, self.spec.num_experts), True
        if self._hp_pa is None:
            return
        import time
        from cmoe.sim.replay.state import export, has_twin, pass_data
        from cmoe.sim.replay.twin_pool import decisions
        from cmoe.executor.streams import marks_per_layer
        h0 = time.perf_counter()
        prog = self._hp_prog() if has_twin(self.policy) else None
        if prog is None:
            return
        M, E, S, pool = self.M, self.spec.num_experts, prog.slot_ptr.shape[1], self.pool
        expert = np.full((M, S), -1, np.int64)
        for m in range(M):
            expert[m, :len(pool.expert[m])] = pool.expert[m]
        state = hp.pool_of(expert)
        W = prog.stage.shape[1]
        ahead = 2 * self.policy.depth * getattr(self.policy, "top", 0) if self.policy.depth > 1 else 0
        marks = 2 + M * (marks_per_layer(self.kin["N"], self.spec.top_k, E, W) + ahead) + 6 * E   # + prefetches
        pa = self._hp_pa
        h = {"run": None, "prog": prog, "pool": state, "s": export(self.policy, pa),
             "d": decisions(M + 1, 1, E), "pd": pass_data(pa), "P": pa.num_passes,
             "books": hp.books(M, E, S, W, marks), "marks": marks, "spent": marks, "ts": np.zeros(2, np.int64),
             "waves": np.zeros(E, np.int64), "gbase": 0, "passes": [], "mk": {}, "ev": []}
        h["run"] = hp.compile_for(hp.run, prog, state, h["s"], h["d"], h["pd"], h["books"], 0, 0, 0, h["ts"], h["waves"])
        self._hp = h                                       # whole, once its program is compiled
        self.log.host_program = True
        self.log.capture_us += (time.perf_counter() - h0) * 1e6

    def _hp_prog(self):
        """The program's `Prog`: graph handles, the read-backs, the slot table's rows, the slots'
        and the experts' addresses; None if a graph, a runtime read-back, a pinned staging row or
        a pinned expert is missing."""
        from cmoe.executor.lean_io import _kin_addresses
        g, M, E, pool, k = self.graphs, self.M, self.spec.num_experts, self.pool, self.kin
        # a layer may run in launch waves (commit's never do: its loads are the next layer's); one
        # with CPU experts always does, their sum joining the waves' before the finish
        waves = not self.commit and (self.has_cpu or min(self.policy.layout.slots) <= min(k["N"] * self.spec.top_k, E))
        if any(("experts", m) not in g or (waves and not {("wave", m), ("finish", m)} <= g.keys()) for m in range(M)):
            return None
        try:
            ex = lambda key: int(g[key].raw_cuda_graph_exec()) if key in g else 0
            gr = np.array([[ex((key, m)) for key in ("attn", "experts", "wave", "finish", "experts-few", "wave-few")]
                           for m in range(M)], np.int64)
            pre, head = ex("pre"), ex("head")
        except (AttributeError, RuntimeError, TypeError):          # a torch without the executable's handle
            return None
        rb = np.zeros((M, 4), np.int64)
        for m in range(M):
            got = self._rb_pin[m] = self._rb_entry(self.t_graph["rb"][m], self._rb_pin[m])
            if got[3] is None:
                return None
            rb[m] = (*got[3], got[1])
        ptr = k["ptr"] = k.get("ptr") or _kin_addresses(k)
        if any(c is None for row in ptr["table"] for c in row):
            return None
        S, nb = max(self.policy.layout.slots), pool.expert_nbytes
        slot_ptr, src_ptr = np.zeros((M, S), np.int64), np.zeros((M, E), np.int64)
        for m in range(M):
            slot_ptr[m, :len(pool._dst_ptr[m])] = pool._dst_ptr[m]
            for e in range(E):
                src = self._srcs.get((m, e))
                if src is None:
                    src = self._srcs[m, e] = self.store.expert(m, e)
                if not (src.device.type == "cpu" and src.is_contiguous() and src.is_pinned() and src.nbytes >= nb):
                    return None
                src_ptr[m, e] = src.data_ptr()
        scal = np.array([pre, head, pool.compute_h, pool._cp_handle, nb, E, int(round(self.clock.host0 * 1e9)),
                         self.spec.top_k, self.commit, 0, 0, self._few_max], np.int64)
        extra = self._hp_commit_inputs(ptr) if self.commit else hp.no_commit(M)
        if extra is None:
            return None
        live = self._hp_live_inputs(rb, scal, extra) if self._hp_live else hp.no_live(M)
        if live is None:
            return None
        extra.update(live)
        # kept while programs run; through a weak reference, so the engine (its pool, graphs and
        # pinned buffers) is not kept alive by its own callback once the run lets it go
        step = weakref.WeakMethod(self._cpu_step)
        self._hp_cb = hp.cpu_callback(lambda m, phase: step()(m, phase)) if self.has_cpu else None
        extra["fn"] = hp.runtime_addresses(self.clock.rt._lib, hp.address(self._hp_cb) if self.has_cpu else 0)
        return hp.Prog(gr, scal, rb, np.array([self.table[m].data_ptr() for m in range(M)], np.int64), k["table_np"],
                       np.array([[c[1] for c in row] for row in ptr["table"]], np.int64), slot_ptr, src_ptr, **extra)

    def _hp_commit_inputs(self, ptr) -> dict | None:
        """commit's Prog fields: the layer-0 prediction's read-back, the candidates' and committed
        set's staging and copies, each pass's rows' predictions (a live run's filled as its
        read-backs land); None where one is missing."""
        k, tp = self.kin, self._hp_tp
        if tp is None and self._hp_live:
            rb0 = self.t_graph["rb0"]
            tp = np.full((1, self.M, rb0.shape[0], rb0.shape[1] // 2), -1, np.int16)
        if not k.get("owa") or tp is None or any(c is None for a in ("ids", "comm") for c in ptr.get(a, [None])):
            return None
        got = self._rb_pin0 = self._rb_entry(self.t_graph["rb0"], self._rb_pin0)
        if got[3] is None:
            return None
        return {"rb0": np.array([*got[3], got[1]], np.int64), "ids": k["ids_np"], "comm": k["comm_np"],
                "ids_ptr": np.array(ptr["ids"], np.int64), "comm_ptr": np.array(ptr["comm"], np.int64), "tp": tp}

    def _hp_live_inputs(self, rb: np.ndarray, scal: np.ndarray, extra: dict) -> dict | None:
        """A live run's Prog fields: one pinned buffer the layers' read-backs (and commit's layer-0
        prediction, its last row) land in, rb's and rb0's host addresses moved into it in place;
        each one's columns (`host_live.layout`); scal's live flag and rows. None (the Python step
        runs) where a read-back is laid out otherwise."""
        import torch
        M, K, E = self.M, self.spec.top_k, self.spec.num_experts
        reads = [self.t_graph["rb"][m] for m in range(M)] + ([self.t_graph["rb0"]] if self.commit else [])
        N, C = reads[0].shape[0], max(r.shape[1] for r in reads)
        pred = [self.t_graph["pred"][m + 1][0].shape[1] if self.policy.uses_prediction and m + 1 < M else 0
                for m in range(M)]
        lv = layout([r.shape[1] for r in reads[:M]], pred, N, K, E, self.commit, reads[-1].shape[1],
                    extra["tp"].shape)
        if lv is None or any(r.dtype != torch.float32 or r.shape[0] != N for r in reads):
            return None
        if self._hp_rbh is None or tuple(self._hp_rbh.shape) != (M + 1, N * C):
            self._hp_rbh = torch.zeros((M + 1, N * C), dtype=torch.float32, pin_memory=self.cuda)
        at = lambda m: self._hp_rbh.data_ptr() + m * N * C * 4
        for m in range(M):
            rb[m, 0] = at(m)
        if self.commit:                                    # the layer-0 prediction: ids, then weights
            extra["rb0"][0] = at(M)
        scal[hp.S_LIVE], scal[hp.S_N] = 1, N
        return {"rbh": self._hp_rbh.numpy(), "lv": lv, "scr": np.zeros(2 * E + max(K, int(lv[:, 1].max())), np.int64)}

    def _hp_mark(self, gid: int, ev: int | None = None) -> Mark:
        """The one Mark object of a program's mark (its time is read once, then its event reused):
        `ev` its event where the caller has it, else looked up in the run's (at its end)."""
        h = self._hp
        mk = h["mk"].get(gid)
        if mk is None:
            if ev is None:
                if not isinstance(h["ev"], np.ndarray):
                    h["ev"] = np.concatenate(h["ev"]) if h["ev"] else np.zeros(0, np.int64)
                ev = h["ev"][gid]
            mk = h["mk"][gid] = Mark(int(ev))
        return mk

    def _hp_pass(self, p) -> None:
        """One graphed decode pass after its inputs: the program, then what `run_pass` reads after
        the layers (the last layer's end mark and host time)."""
        h = self._hp
        b = h["books"]
        self._hp_refill(b.ev, h["spent"])                  # all of books.ev before the first pass
        h["prog"].scal[hp.S_CS] = self.pool.compute_h
        self._tick("pass: program entry")
        gbase = h["gbase"]
        pi = p.index                                       # the pass in the twin's arrays
        if self._hp_live:                                  # a live pass: planned as pass 0 of its own arrays
            assert p.replay is None and p.active.all(), "a live run's pass that the program cannot plan"
            pi = 0
        rc = h["run"](h["prog"], h["pool"], h["s"], h["d"], h["pd"], b, gbase, pi, h["P"], h["ts"], h["waves"])
        self._tick("pass: program (its layers)")
        c = b.cnt
        n = h["spent"] = int(c[hp.C_MARKS])                # b.ev[:n] are the run's marks now; the rest wait
        if self._hp_error is not None:                     # the CPU experts' step failed (`_cpu_step`)
            exc, self._hp_error = self._hp_error, None
            raise exc
        if rc or c[hp.C_ERR]:
            err, what = int(c[hp.C_ERR]), hp.CALLS[c[hp.C_ERRCALL]]
            why = f"{what} failed (error {err})" if err > 0 else what if err == -1 else "plan and pool disagree"
            raise RuntimeError(f"the host program stopped in pass {p.index}: {why}")
        h["ev"].append(b.ev[:n].copy())                  # mark gid's event: the run's, in order
        h["gbase"] = gbase + n
        nw, nx, nl = int(c[hp.C_WAVES]), int(c[hp.C_WX]), int(c[hp.C_LOADS])
        h["passes"].append((p.index, self.last, self.h_last, b.lay_i.copy(), b.lay_f.copy(), b.wav_i[:nw].copy(),
                            b.wav_f[:nw].copy(), b.wx[:nx].copy(), b.ld[:nl].copy(), int(c[hp.C_SKIPPED]),
                            b.pass_f.copy()))
        if self.record_plans:
            self._hp_plans(p.index, b, pi)
        M = self.M
        last = int(b.lay_i[M - 1, hp.L_LAST])
        self.last, self.h_last = self._hp_mark(last, b.ev[last - gbase]), float(b.lay_f[M - 1, hp.F_LAST])
        self._tick("pass: program records")

    def _hp_refill(self, ev: np.ndarray, n: int) -> None:
        """The program's events for a pass: the n its last pass recorded (its marks, read at the
        run's end; all of `ev` before the first pass) replaced from the clock's free ones, the rest
        kept where they are. Handing all of them back and taking them again each pass cost 13-30 us
        of the host's pass boundary on 2026-12-05's AMD CPU at 402-786 events (the GPU waits for the
        boundary); this moves only the used ones."""
        if n == 0:
            return
        marks = self.clock._marks
        if len(marks.free) < n:                            # the reserve ran out: made now, counted late
            marks.late += n - len(marks.free)
            marks.reserve(n)
        ev[:n] = marks.free[-n:]
        del marks.free[-n:]

    def _hp_plans(self, p: int, b, pi: int) -> None:
        """The pass's `PlanRecord`s as the Python step makes them, from the twin's decisions (still in
        its buffer) and the program's snapshots of each layer's slots; pi: the pass in the twin's
        arrays (a live run's is always 0, its arrays rewritten each pass)."""
        from cmoe.executor.records import PlanRecord
        from cmoe.sim.replay.twin_pool import LOAD_KINDS
        d, pa, M = self._hp["d"], self._hp_pa, self.M
        for j in range(M + 1):
            g, c = d.g_e[d.g_ptr[j]:d.g_ptr[j + 1]].tolist(), d.c_e[d.c_ptr[j]:d.c_ptr[j + 1]].tolist()
            lds = tuple((int(d.l_layer[i]), int(d.l_e[i]), int(d.l_slot[i]), None if d.l_victim[i] < 0 else int(d.l_victim[i]),
                         LOAD_KINDS[d.l_kind[i]]) for i in range(d.l_ptr[j], d.l_ptr[j + 1]))
            if j == 0:                                    # commit's begin reads layer 0's prediction
                pred0 = tuple(pa.pred[pa.pred_ptr[pi * M]:pa.pred_ptr[pi * M + 1]].tolist()) if self.commit else ()
                self.log.plans.append(PlanRecord(p, -1, (), pred0, lds, (), (), (), (), ()))
                continue
            m = j - 1
            needed = tuple(pa.needed(pi, m).tolist())
            i = pi * M + m + 1
            pred = tuple(pa.pred[pa.pred_ptr[i]:pa.pred_ptr[i + 1]].tolist()) \
                if self.policy.uses_prediction and m + 1 < M else None
            n = len(self.pool.expert[m])
            self.log.plans.append(PlanRecord(p, m, needed, pred, lds, tuple(g), tuple(c),
                                             tuple(e for e in needed if e not in g and e not in c),
                                             tuple(b.phys[m, :n].tolist()), tuple(b.logi[m, :n].tolist())))

    def _hp_occupancy(self) -> int:
        return int(self._hp["s"].scal[hp.OCC])

    def _hp_finish(self) -> None:
        """The run's records as the Python step leaves them (spans, experts to classify, launches to
        split, loads and skips tallied), the policy object's state from its twin, the pool's
        slots as the device holds them."""
        h = self._hp
        if h is None:
            return
        from cmoe.sim.replay.state import restore
        for rec in h["passes"]:
            self._hp_spans(*rec)
        restore(self.policy, h["s"])
        pool = h["pool"]
        for m in range(self.M):
            n = len(self.pool.expert[m])
            self.pool.expert[m] = pool.expert[m, :n].tolist()
        self.pool._forget()                               # the device has finished: nothing in flight
        h["passes"] = []
        self.clock._marks.free.extend(h["books"].ev[h["spent"]:].tolist())   # those no pass recorded
        h["spent"] = h["marks"]                          # given back: a second finish gives none

    def _hp_spans(self, p, last, h_last, lay_i, lay_f, wav_i, wav_f, wx, ld, skipped, pass_f) -> None:
        """One pass's records as `_enter_layer`, `_plan_layer` and `_launch_waves` (or commit's
        `_pred0_host` and `_commit_layer`) leave them: spans, experts to classify, launches, loads."""
        d, mk, nb = self.spec.moe_layers, self._hp_mark, self.pool.expert_nbytes
        pend, commit = self._pending, self.commit
        if commit:                                        # the layer-0 prediction's read-back
            pend += [(p, d[0], "host", "host_attention", -1, h_last, pass_f[0], 0),
                     (p, d[0], "host", "host_sync", -1, pass_f[0], pass_f[1], 0)]
            h_last = pass_f[1]
        for m in range(self.M):
            t_in, t_plan = mk(int(lay_i[m, hp.L_TIN])), mk(int(lay_i[m, hp.L_TPLAN]))
            h_in, h_synced, h_routed, h_end, h_rb = (float(x) for x in lay_f[m])
            pend += [(p, d[m], "compute", "attention", -1, last, t_in, 0),
                     (p, d[m], "host", "host_attention", -1, h_last, h_in, 0),
                     (p, d[m], "host", "host_sync", -1, h_rb if commit else h_in, h_synced, 0),
                     (p, d[m], "host", "host_route", -1, h_synced, h_routed, 0),
                     (p, d[m], "compute", "route", -1, t_in, t_plan, 0)]
            last, h_last = mk(int(lay_i[m, hp.L_LAST])), h_end
        for w in range(len(wav_i)):
            m, t0, t1, x0 = (int(x) for x in wav_i[w])
            x1 = int(wav_i[w + 1, 3]) if w + 1 < len(wav_i) else len(wx)
            h0, h1 = float(wav_f[w, 0]), float(wav_f[w, 1])
            for e, own, landed, due in wx[x0:x1].tolist():
                self._experts.append((p, bool(own), mk(landed) if landed >= 0 else None, mk(due), h0))
            if x1 > x0:                                   # `_fused_span`: one launch, split per expert
                self._fused.append((p, d[m], tuple(int(e) for e in wx[x0:x1, 0]), mk(t0), mk(t1), self.store.slot))
            pend.append((p, d[m], "host", "host_expert", -1, h0, h1, 0))
        for lm, e, _s, t0, t1 in ld.tolist():
            pend.append((p, d[lm], "copy0", "load", e, mk(t0), mk(t1), nb))
            self.log.loaded(p, nb)
        self.log.at(p).skipped += skipped
