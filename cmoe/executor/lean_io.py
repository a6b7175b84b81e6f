"""What crosses between the host and the device in the lean engine's host step for a layer: the
layer's read-back (`_read_back_start`, `_read_back_wait`) and the kernel inputs the host writes
(the slot table's row, commit's ids, weights and committed set). A mixin of
`cmoe.executor.lean.LeanEngine`, through `cmoe.executor.lean_steps.HostSteps`; and a graphed
decode pass's own inputs (`pass_inputs`: the cache's slot and mask column, ids, positions, routes).

On CUDA these go through the CUDA runtime torch loaded (`cmoe.executor.cuda_rt`), where it was
found: the read-back is its device-to-host `cudaMemcpyAsync` into the layer's pinned buffer and a
`cudaEventRecord` of the layer's own event, waited for with `cudaEventSynchronize`; an input's row
is one host-to-device `cudaMemcpyAsync` from its pinned staging. Measured on the H200's host
(`benchmarks/host_ops_h200.py`, median per call, `benchmarks/results/lean-h200-6/host-ops.json`):
torch's `copy_(non_blocking=True)` of a 32-byte pinned tensor 3.48 us, a new torch event and its
record 3.09 us; the runtime's `cudaEventRecord` 0.84 us. The runtime's small copies and its
read-back have not been timed alone (the script times them now; its expert copy took 2.55 us);
the whole step's change is in BENCHMARKS.md (seventh session). Without the runtime, torch's calls.
"""

from __future__ import annotations

import numpy as np
import torch

from cmoe.executor.cuda_rt import D2D, D2H, H2D


class HostIO:
    def _read_back(self, m: int) -> np.ndarray:
        """The layer's one read-back: a non-blocking copy into pinned memory, then its event."""
        return self._read_back_wait(self._read_back_start(m))

    def _read_back_start(self, m: int):
        """Queue the read-back copy on the compute stream (behind A_m, ahead of anything queued
        later, such as commit's experts) and record its event; `_read_back_wait` waits for it.
        What the copy needs is worked out once per source tensor (`_rb_entry`): a graph's
        read-back buffer is the same tensor every pass, so a replayed layer asks torch nothing."""
        rb = self.t["rb"][m]
        if not self.cuda:
            return rb.numpy(), None
        got = self._rb_pin[m]
        if got is None or got[2] is not rb:
            got = self._rb_pin[m] = self._rb_entry(rb, got)
        return self._rb_queue(got)

    def _read_back_pred0(self):
        """commit's layer-0 prediction (`t["rb0"]`, which the pre segment makes) to the host, as a
        layer's read-back is (`_read_back_wait` waits for it): with queued passes the host need not
        wait for the whole pass before, only for this pass's pre segment behind it. None when the
        pass has no such buffer."""
        rb = self.t.get("rb0")
        if rb is None:
            return None
        if not self.cuda:
            return rb.numpy(), None
        got = self._rb_pin0
        if got is None or got[2] is not rb:
            got = self._rb_pin0 = self._rb_entry(rb, got)
        return self._rb_queue(got)

    def _pred0_host(self):
        """commit in decode: the layer-0 prediction read back (`_read_back_pred0`), the host's wait
        for it a `host_sync` span of the first MoE layer, apart from the host's own work before it
        (its `host_attention`), as a layer's read-back wait is. None otherwise."""
        started = self._read_back_pred0() if self.commit and self.cur.decode else None
        if started is None:
            return None
        d0, h0 = self.spec.moe_layers[0], self.clock.host()
        host = self._read_back_wait(started)
        h1 = self.clock.host()
        self._span(d0, "host", "host_attention", -1, self.h_last, h0)
        self._span(d0, "host", "host_sync", -1, h0, h1)
        self.h_last = h1
        return host

    def _rb_queue(self, got):
        """A read-back entry's copy and event queued on the compute stream: (host array, event)."""
        pin, ev, rb, args, host = got
        if args is not None:                               # the runtime's copy and the layer's own event
            rt, h = self.clock.rt, self.pool.compute_h
            rt.copy(args[0], args[1], args[2], D2H, h)
            rt.record(ev, h)
            return host, ev
        pin.copy_(rb, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.cs)
        return host, ev

    def _rb_entry(self, rb: torch.Tensor, got) -> tuple:
        """Layer m's read-back of `rb`: (pinned buffer, the layer's runtime event or None, rb, the
        runtime copy's (host, device, bytes) or None for torch's copy, the buffer as numpy). A new
        shape (prefill, then decode) takes a new buffer; the layer's event is kept."""
        rt = self.clock.rt
        if got is None or got[0].shape != rb.shape:
            pin = torch.empty(rb.shape, dtype=rb.dtype, pin_memory=True)
            ev = got[1] if got is not None else self.clock.order_event() if rt is not None else None
        else:
            pin, ev = got[0], got[1]
        args = (pin.data_ptr(), rb.data_ptr(), pin.nbytes) if ev is not None and rb.is_contiguous() else None
        return pin, ev, rb, args, pin.numpy()

    def _read_back_wait(self, started) -> np.ndarray:
        """Wait for the read-back's event: the runtime's (or torch's) event synchronize, or with
        CMOE_WAIT=spin (`_spin`, an A/B) the host polls the event in a loop and never leaves the
        CPU, a question about the lent host: whether a wait that blocks is what makes the host's
        next layer slower after a long load (benchmarks/lean_h200.py --wait-ablation). On the
        H200 (tenth session) it is not: the step after a long wait stayed as slow polling, and
        polling cost 2.7% at pool 26 batch 2, so the sync is the default (BENCHMARKS.md)."""
        host, ev = started
        if ev is None:
            return host
        runtime = type(ev) is int
        if getattr(self, "_spin", False):              # LeanEngine sets it; the host-step tests' stand-ins do not
            happened = (lambda: self.clock.rt.query(ev)) if runtime else ev.query
            while not happened():
                pass
        elif runtime:
            self.clock.rt.sync(ev)
        else:
            ev.synchronize()
        return host

    def _set_table(self, m: int, slots: dict[int, int], wave: int = 0) -> None:
        """Row m of the device's expert -> slot table, for one launch (`wave`) of the layer: written
        into its own pinned staging row and copied without blocking, on the compute stream, so
        the launch after it reads it and a later wave's row never overwrites one not yet read."""
        if not self.cuda:
            row = self._table_host[m]
            row.fill(-1)
            for e, s in slots.items():
                row[e] = s
            self.table[m].copy_(torch.from_numpy(row))
            return
        row = self.kin["table_np"][m, wave]
        row.fill(-1)
        for e, s in slots.items():
            row[e] = s
        self._copy_in("table", m, wave)

    def _copy_in(self, what: str, m: int, wave: int = 0) -> None:
        """Layer m's row of a kernel input the host wrote (`what`: table, with its wave's staging
        row, or ids, w, comm), from its pinned staging into the device tensor, without blocking, on
        the compute stream: the runtime's cudaMemcpyAsync, else torch's `copy_`. Either way the
        staging is what keeps the copy right: each layer and wave has its own row, written again
        only in a later pass, and only after the host has waited there for something queued
        behind this copy (the layer's read-back, or for commit's layer 0 the prediction's
        `.cpu()`): decode passes are queued without a sync between them, so a step that wrote a
        row before any wait in its pass could race the last pass's copy of it. The row lives as
        long as kin (torch's pinned-memory bookkeeping, skipped by the runtime's copy, only
        guards a freed buffer)."""
        k, rt = self.kin, self.clock.rt
        if rt is not None:
            ptr = k.get("ptr")
            if ptr is None:
                ptr = k["ptr"] = _kin_addresses(k)
            c = ptr[what][m][wave] if what == "table" else ptr[what][m]
            if c is not None:
                rt.copy(c[0], c[1], c[2], H2D, self.pool.compute_h)
                return
        if what == "table":
            k["rows"][m].copy_(k["stage"][m][wave], non_blocking=True)
        else:
            k[what + "_m"][m].copy_(k[what + "_h_m"][m], non_blocking=True)

    def _write_assignment(self, m: int, assign: dict, N: int) -> None:
        """commit in decode: each row's committed experts and OWA weights, the kernel's inputs."""
        k = self.kin
        ids, w = k["ids_np"][m], k["w_np"][m]
        ids.fill(-1)
        w.fill(0.0)
        fill = [0] * N
        for e, pairs in assign.items():
            for i, wt in pairs:
                j = fill[i]
                ids[i, j] = e
                w[i, j] = wt
                fill[i] = j + 1
        self._copy_in("ids", m)
        self._copy_in("w", m)

    def _write_candidates(self, m: int, chosen: list[int], live: list[int]) -> None:
        """commit's kernel inputs for layer m: each live row's predicted experts that were committed
        (up to top_k, the device's OWA weights them) and the committed set, copied without blocking."""
        k, K, keep = self.kin, self.spec.top_k, set(chosen)
        ids = k["ids_np"][m]
        ids.fill(-1)
        for i in live:
            mine = [e for e in dict.fromkeys(self.token_pred[m][i]) if e in keep][:K]
            ids[i, :len(mine)] = mine
        comm = k["comm_np"][m]
        comm.fill(False)
        comm[chosen] = True
        self._copy_in("ids", m)
        self._copy_in("comm", m)


def _kin_addresses(k: dict) -> dict:
    """(device address, pinned address, bytes) of each host-written kernel input's row, per layer
    (the table's per layer and wave), for the runtime's copies; None where a row is not a
    contiguous pinned buffer of its device row's size (torch copies it)."""
    def pair(d, s):
        ok = d.is_cuda and s.is_pinned() and d.is_contiguous() and s.is_contiguous() and d.nbytes == s.nbytes
        return (d.data_ptr(), s.data_ptr(), d.nbytes) if ok else None
    out = {"table": [[pair(d, s) for s in stage] for d, stage in zip(k["rows"], k["stage"])]}
    for a in ("ids", "w", "comm"):
        if a + "_m" in k and a + "_h_m" in k:
            out[a] = [pair(d, s) for d, s in zip(k[a + "_m"], k[a + "_h_m"])]
    return out


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda


def pass_inputs(rt, kv, pairs: list, h: int, table: torch.Tensor | None, stepped: bool = False) -> None:
    """A graphed decode pass's inputs on the compute stream (handle `h`): the cache's next slot and
    its mask column, then each (destination, source) pair of device tensors (the token ids and
    positions, a replay's routes). With the runtime and the cache's `slot_table`, one call each,
    ~1 us against ~15-30 for a torch op on the H200's host (six of them took ~170 us a pass before
    layer 0 could be issued): the slot from the table, the column by `cudaMemset2DAsync`, each
    pair device to device, or by torch's copy where a pair is not two like tensors (`_like`).
    Without them, torch's ops. The sources are the caller's tensors, on the compute stream's
    allocations (stream order keeps them).

    `stepped`: the pass's first graph moves the slot and its mask column on the device
    (`StaticKV.device_step`), so only the host's count moves here. The slot's copy from pinned
    memory goes through the one host-to-device engine, and beside a moving load it waited there:
    layer 0's GPU part took 25-29 us longer on the twenty-fourth session's runs whenever a load was
    moving (BENCHMARKS.md, twenty-fifth session), as the read-back's table copy does."""
    fast = rt is not None and (stepped or table is not None)
    if stepped:
        kv.advance()
    elif not fast:
        kv.step()
    else:
        s, v = kv.advance(), kv.valid
        rt.copy(kv.slots.data_ptr(), table.data_ptr() + 8 * s, 8, H2D, h)
        rt.memset2d(v.data_ptr() + s, v.stride(0), 1, 1, v.shape[0], h)
    for d, src in pairs:
        if fast and _like(d, src):
            rt.copy(d.data_ptr(), src.data_ptr(), d.nbytes, D2D, h)
        else:                                  # another dtype (a recorded trace's int32 ids), a view
            d.copy_(src, non_blocking=True)


def _like(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Two contiguous tensors of one dtype and size on one device: a copy of their bytes."""
    return (_on_device(d) and _on_device(s) and d.device == s.device and d.dtype == s.dtype
            and d.numel() == s.numel() and d.is_contiguous() and s.is_contiguous())


def slot_table(kv) -> torch.Tensor | None:
    """The cache's positions 0..max_len-1 as int64 in pinned memory, `pass_inputs`' source of its
    slot; None where its slot and mask are not what the runtime's calls write (an int64 slot, a
    contiguous bool mask), so torch's ops do. Made once, at capture: no timed pass pays the pinned
    allocation or the checks."""
    v = kv.valid
    if not (v.is_contiguous() and v.dtype == torch.bool and kv.slots.dtype == torch.int64):
        return None
    t = torch.empty(kv.max_len, dtype=torch.int64, pin_memory=True)
    t.copy_(torch.arange(kv.max_len, dtype=torch.int64))
    return t
