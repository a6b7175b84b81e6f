"""The lean engine's device program (`cmoe.executor.lean`): its segments P, A_m, X_m and H as
device work only, run eagerly or recorded into CUDA graphs, and the capture of those graphs on
the first decode pass. A mixin of `LeanEngine`: the host's side of a layer is in `lean_steps`,
the pass loop and bookkeeping in `lean`. Shapes: B rows (batch), N = B * tokens, H hidden,
E experts, M MoE layers; `t` holds each segment's tensors by layer (`_fresh`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from cmoe.executor.few_experts import describe, threshold
from cmoe.executor.lean_steps import owa_device


def queues_passes(cuda: bool) -> bool:
    """Whether the lean engine queues its graphed decode passes back to back, with no sync between
    them (on CUDA; CMOE_PASS_SYNC=1 keeps a sync at each end, for the A/B): the engine itself, and
    calibrate, which sets the profile's `pass_overlap` by it and prices the host's pass start so.
    The calibration's GPU-sleep runs keep the syncs whatever this says (`LeanEngine.run_pass`)."""
    return cuda and os.environ.get("CMOE_PASS_SYNC", "0") != "1"


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


def _fresh(M: int) -> dict:
    return {"x": [None] * M, "idx": [None] * M, "w": [None] * M, "logits": [None] * M, "mid": [None] * M,
            "shared": [None] * M, "pred": [None] * M, "rb": [None] * M, "h": [None] * M, "deep": [None] * M}


class Segments:
    # the few-expert kernel configuration (`cmoe.executor.few_experts`): _few_cfg, while set, the
    # configuration every expert launch runs (the twins' warm-up and capture, `_twin_config`);
    # _few_max, the most experts a launch may name and replay the captured twins (0: none captured)
    _few_cfg = None
    _few_max = 0

    def _fuse(self, model, family: str) -> None:
        """The one-launch kernels on CUDA, each with its switch for an A/B: RMSNorm (CMOE_FUSED_NORM),
        the decode attention (`attention.install`), the layer's add and norm (`_moe_decoder`,
        CMOE_LEAN_LAYER), the router's top-k and X_m's sum (CMOE_FUSED_STEPS)."""
        self._fused_mods: list = []                        # modules whose forward is a one-launch kernel
        if self.cuda and os.environ.get("CMOE_FUSED_NORM", "1") != "0":
            from cmoe.executor.kernels_triton.norm import fuse_norms
            self._fused_mods = fuse_norms(model)
        from cmoe.executor import attention
        self._attn = attention.install(model, family, self.cuda)
        self._lean_layer = self.cuda and family in attention.FAMILIES \
            and os.environ.get("CMOE_LEAN_LAYER", "1") != "0"
        self._fold_norm = False                            # CMOE_QKV_NORM=1: `_moe_decoder` folds the input norm
        if self._lean_layer and self._attn:
            from cmoe.executor.kernels_triton import gemv
            self._fold_norm = gemv.enabled() and gemv.norm_enabled()
        self._steps = self.cuda and os.environ.get("CMOE_FUSED_STEPS", "1") != "0"
        if self._steps:
            from cmoe.executor.kernels_triton.steps import fuse_routers
            self._fused_mods += fuse_routers(model)

    def _drop_program(self) -> None:
        """At close: the model's modules as they were (norms, attention), and the graphs and the
        buffers they were captured over let go."""
        if self._fused_mods:
            from cmoe.executor.kernels_triton.norm import unfuse
            unfuse(self._fused_mods)
            self._fused_mods = []
        if self._attn:
            from cmoe.executor import attention
            attention.uninstall(self._attn)
            self._attn = []
        self.graphs = None
        self.t = self.t_graph = self.kin = self.io = self._ws = self._wave_acc = None
        self._rb_pin = []
        self._cap.sink = {}

    def _decoder(self, d: int, h: torch.Tensor) -> torch.Tensor:
        io = self.io
        out = self.layers[d](h, attention_mask=io["mask"], position_ids=io["pos"], past_key_values=self.kv,
                             position_embeddings=self.t["pe"])
        return out[0] if isinstance(out, tuple) else out

    def _moe_decoder(self, m: int, h: torch.Tensor) -> None:
        """MoE layer m's decoder layer up to its experts: transformers' forward, or where the engine
        may (`_lean_layer`: CUDA, the families whose decoder layers are input norm, attention,
        residual add, post-attention norm, MLP, residual add) the same steps with the add and the
        post-attention norm in one launch (`add_rms_norm`, which keeps mid for X_m) and without the
        final add: X_m adds the residual itself, so transformers' sum (of mid and the MoE block's
        zeros or shared part) was a launch whose result nobody read. CMOE_LEAN_LAYER=0: the A/B."""
        d = self.spec.moe_layers[m]
        if not self._lean_layer:
            self._decoder(d, h)                             # hooks keep mid, x, routing, shared
            return
        from cmoe.executor.kernels_triton.norm import add_rms_norm
        layer, io = self.layers[d], self.io
        fd = layer.self_attn.__dict__.get("forward")       # `attention.FastDecode` where installed
        if self._fold_norm and h.shape[0] == 1 and hasattr(fd, "normed"):
            # CMOE_QKV_NORM=1: the input norm folded into the q/k/v GEMV where `normed` can. Its module
            # then does not run, so its hooks do not fire: layer 0's (`_on_src0`) is read only by
            # seg_pre, which runs it
            a, _ = fd.normed(layer.input_layernorm, h, self.t["pe"], io["mask"], self.kv, position_ids=io["pos"])
        else:
            a, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=io["mask"],
                                   position_ids=io["pos"], past_key_values=self.kv, position_embeddings=self.t["pe"])
        self.t["mid"][m], x = add_rms_norm(h, a, layer.post_attention_layernorm)
        layer.mlp(x)                                        # hooks keep x, routing, shared

    def _predict(self, m: int, src: torch.Tensor) -> None:
        """MoE layer m's router on an earlier hidden state. Eager, its host time is a `host_predict`
        span; inside a graph it costs the host nothing (its GPU time lies in `attention`)."""
        h0 = self.clock.host()
        self.t["deep"][m] = self._early_routers(m, src.reshape(-1, src.shape[-1]))
        self.t["pred"][m] = self.t["deep"][m][0]
        if not self._in_graph:
            self._span(self.spec.moe_layers[m], "host", "host_predict", -1, h0, self.clock.host())

    def _deep(self, q: int):
        return self.t["deep"][q]

    def seg_pre(self) -> None:
        t, io = self.t, self.io
        h = self.model.model.embed_tokens(io["ids"])
        t["pe"] = self.model.model.rotary_emb(h, io["pos"])
        for d in self._dense_before[0]:
            h = self._decoder(d, h)
        t["h_in0"] = h
        if (self.commit or self.policy.depth > 1) and self.cur.decode:
            if self.spec.moe_layers[0] == 0:                # the source is layer 0's input norm
                t["src0"] = self.layers[0].input_layernorm(h)
            self._predict(0, t["src0"])
            if self.commit:                                  # its one read-back (`_read_back_pred0`)
                idx, w = t["pred"][0]
                t["rb0"] = torch.cat([idx.float(), w.float()], 1)

    def _pre_stepped(self) -> None:
        """P as captured: the cache's step on the device, then `seg_pre`."""
        self.kv.device_step()
        self.seg_pre()

    def seg_attn(self, m: int) -> None:
        t = self.t
        h = t["h_in0"] if m == 0 else t["h"][m - 1]
        for d in self._dense_before[m] if m else ():
            h = self._decoder(d, h)
        self._moe_decoder(m, h)
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
            parts += [t["pred"][m + 1][0].float(), t["pred"][m + 1][1].float()] + self._deeper_parts(m + 1)
        return parts

    def _kernel(self, m: int, table: torch.Tensor, out_dtype=None) -> torch.Tensor:
        """The routed experts of layer m from the slots `table` points at, in x's dtype (or
        out_dtype: fp32 for a wave's partial sum, rounded once when the waves are added), on the
        rows' configuration or, within `_twin_config`, the few-expert one."""
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
                           config=self._few_cfg, out_dtype=out_dtype)

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
        if self.silent and self.cur.replay is None:        # upper's bookkeeping: every layer's choice
            # (a replayed pass knows its routes already); two stacks and one cast, not 3 launches per
            # layer: on the H200 those made the 32-layer head 175 us against the 4-layer cut's 85
            t["all_idx"] = torch.cat([torch.stack(t["idx"]).float(), torch.stack(t["w"]).float()], -1)

    # --- graphs ----------------------------------------------------------------------------------
    def _capture(self, B: int) -> None:
        """Warm up and record the decode segments, over the static inputs (first decode pass)."""
        h0 = time.perf_counter()
        dev = self.device
        self._capture_inputs(B)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        self.t = _fresh(self.M)
        self._cap.sink = self.t
        self._static_out = False
        self._in_graph = True
        # CPU-expert policies too: a layer's GPU experts replay as the others' do, and its CPU
        # experts' sum joins the waves' before the finish (`HostSteps._host_layer`)
        waves = self.fused and not self.silent and not self.commit \
            and os.environ.get("CMOE_WAVE_GRAPHS", "1") != "0"
        few = threshold(B) if waves else 0                 # `few_experts`: where a launch is split
        self.log.few_experts = describe() if waves else None    # what the run's metrics record
        with torch.cuda.stream(side), torch.no_grad():    # warm-up: compiles kernels, sizes buffers
            for _ in range(2):
                self._program_eager()
            if few:                                        # the twins' configuration, compiled here
                with self._twin_config():
                    self._kernel(0, self.table[0], torch.float32)
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

        if waves:                                          # a layer in launch waves: one replay a wave
            self._wave_acc = torch.zeros((B, self.spec.hidden), dtype=torch.float32, device=dev)
        rec("pre", self._pre_stepped if self._stepped else self.seg_pre)
        for m in range(self.M):
            self._record_layer(rec, m, waves, few)
        rec("head", self.seg_head)
        torch.cuda.synchronize(dev)
        if self._stepped:
            self.kv.aim_device_steps()                     # P's first replay steps to this pass's slot
        self.graphs = g
        self._few_max = few
        self.t_graph = self.t
        self._static_out = True
        self._in_graph = False
        self.log.capture_us = (time.perf_counter() - h0) * 1e6

    def _record_layer(self, rec, m: int, waves: bool, few: int) -> None:
        """Layer m's graphs: A_m, X_m, with waves a wave's launch and the finish, and with few > 0
        twins of X_m and the wave on the few-expert kernel configuration (`few_experts`: a launch
        naming at most `few` experts replays them), writing the tensors the first ones write."""
        rec(("attn", m), self.seg_attn, m)
        if self.fused:
            rec(("experts", m), self.seg_experts, m)
        else:                                          # eager experts write into this buffer
            self.t["h"][m] = torch.empty_like(self.t["mid"][m])
        if waves:
            rec(("wave", m), self._wave_add, m)
            self._static_out = True                    # finish writes X_m's own output tensor
            rec(("finish", m), self._wave_finish, m)
            self._static_out = False
        if few:
            with self._twin_config():
                self._static_out = True
                rec(("experts-few", m), self.seg_experts, m)
                rec(("wave-few", m), self._wave_add, m)

    @contextmanager
    def _twin_config(self):
        """Every expert launch inside runs the few-expert configuration (`few_experts.FEW_BUCKET`'s);
        after, even where a capture failed, the rows' own again and `_static_out` off."""
        from cmoe.executor.few_experts import FEW_BUCKET
        from cmoe.executor.kernels_triton import CONFIGS
        self._few_cfg = CONFIGS[FEW_BUCKET]
        try:
            yield
        finally:
            self._few_cfg, self._static_out = None, False

    def _capture_inputs(self, B: int) -> None:
        """The graphs' static inputs: ids, positions, the kernels' inputs and workspace, the cache
        aimed at this pass's slot for the warm-up."""
        dev = self.device
        self.io = {"ids": torch.zeros((B, 1), dtype=torch.long, device=dev),
                   "pos": torch.zeros((B, 1), dtype=torch.long, device=dev), "mask": self.kv.decode_mask}
        self._make_kin(B, decode=True)
        if self.fused:
            from cmoe.executor.kernels_triton import Workspace
            self._ws = Workspace(B, self._kin_k, self.spec.hidden, self.spec.expert_ffn, self.spec.num_experts, dev)
        self.kv.aim_decode()                             # warm-up writes where this pass will write
        # CMOE_DEVICE_STEP=1: the pass's slot moved on the device by P's graph (`StaticKV.device_step`),
        # else copied in by `pass_inputs`; opt-in: on an H100 it gained no tokens/s (twenty-sixth session)
        self._stepped = os.environ.get("CMOE_DEVICE_STEP", "0") == "1"
        self._rt_inputs = self.clock.rt is not None and os.environ.get("CMOE_RUNTIME_INPUTS", "1") != "0"
        if self._rt_inputs and not self._stepped:         # (CMOE_RUNTIME_INPUTS=0: torch's ops, an A/B)
            from cmoe.executor.lean_io import slot_table  # `pass_inputs`' positions, pinned, untimed
            self._slot_src = slot_table(self.kv)

    def _program_eager(self) -> None:
        self.seg_pre()
        for m in range(self.M):
            self.seg_attn(m)
            if self.fused:
                self.seg_experts(m)
            else:
                self.t["h"][m] = self.t["mid"][m] + self.t["shared"][m]
        self.seg_head()
