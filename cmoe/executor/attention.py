"""Decode attention in three launches for the Llama-style attention modules (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE): one projection for q, k and v together, one kernel that rotates q and k, writes
k and v into the static cache and attends over it (GQA in place, the mask read from the cache's
valid slots; on the CPU two torch steps, `rope_write` and `attend`), then o_proj.

Why: under the lean engine's graphs the host no longer pays per launch, but the GPU still pays
~2-3 us a graph node, and transformers' decode attention is about twenty launches (three
projections, rotate_half's slices, negation and concatenation for q and k, four products and
two sums, two cache writes, repeat_kv's two copies of the whole cache because a mask is given,
then SDPA). The module's own forward still serves every pass that is not a one-token decode
step over a `StaticKV` (prefill, the reference engine, the families it does not cover: MLA).

Arithmetic: the rotation is transformers' `q * cos + rotate_half(q) * sin` with each product and
the sum rounded to the activations' dtype, as the element-wise ops round, so q and the cached k
equal the module's given the same projections (the one q/k/v matmul may round differently from
three, as any change of GEMM shape can). On the CPU the same program runs with torch's own ops
(`rope_write`, `attend`: what the module computes, SDPA over repeat_kv); on CUDA one kernel of
`cmoe.executor.kernels_triton.attention` replaces both (two with CMOE_ROPE_ATTEND=0; the attention
in fp32 with an online softmax: not bit-equal to SDPA, checked against it in the GPU tests). The q, k, v projection is
one matmul over the three weights stacked; the modules' weights become views of that stack, so
no memory is added and the module's forward reads the same numbers.

Set CMOE_FAST_ATTN=0 to keep transformers' attention (the A/B of BENCHMARKS.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# family -> where its q/k norm sits: None (none), "head" (over each head's dim: Qwen3-MoE),
# "full" (over the whole projection, before the heads split: OLMoE)
FAMILIES = {"mixtral": None, "qwen2_moe": None, "qwen3_moe": "head", "olmoe": "full"}


def enabled() -> bool:
    return os.environ.get("CMOE_FAST_ATTN", "1") != "0"


def rope_write(q, k, v, cos, sin, keys, values, slot):
    """q [B, Hq, D], k and v [B, Hkv, D], cos and sin [B, D]; keys and values [B, Hkv, L, D],
    slot a one-element long tensor. Writes rotated k and v at the slot; returns rotated q."""
    def rot(x):
        c, s = cos[:, None], sin[:, None]
        h = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s
    keys.index_copy_(2, slot, rot(k)[:, :, None])
    values.index_copy_(2, slot, v[:, :, None])
    return rot(q)


def attend(q, keys, values, valid, scaling):
    """q [B, Hq, D] over keys/values [B, Hkv, L, D] where valid [B, L]: [B, Hq * D]."""
    B, Hq, D = q.shape
    g = Hq // keys.shape[1]
    if g > 1:
        keys = keys.repeat_interleave(g, 1)
        values = values.repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=valid[:, None, None, :],
                                       scale=scaling)
    return o.reshape(B, Hq * D)


class FastDecode:
    """One attention module's decode step (see the module docstring); `install` sets it up."""

    def __init__(self, attn, norm: str | None):
        self.a, self.norm = attn, norm
        self.orig = attn.forward
        qp, kp, vp = attn.q_proj, attn.k_proj, attn.v_proj
        self.D = attn.head_dim
        self.nq, self.nk = qp.out_features, kp.out_features
        if vp.out_features != self.nk or self.nq % self.D or self.nk % self.D:
            raise ValueError("q, k and v heads of unequal shapes")
        with torch.no_grad():
            w = torch.cat([qp.weight, kp.weight, vp.weight])
            self.w = w
            b = None
            if qp.bias is not None:
                b = torch.cat([qp.bias, kp.bias, vp.bias])
            self.b = b
            o = 0
            for lin, n in ((qp, self.nq), (kp, self.nk), (vp, self.nk)):
                lin.weight = torch.nn.Parameter(w[o:o + n], requires_grad=False)
                if b is not None:
                    lin.bias = torch.nn.Parameter(b[o:o + n], requires_grad=False)
                o += n
        clip = getattr(attn.config, "clip_qkv", None)
        self.clip = float(clip) if clip is not None else None
        self.kernels = None
        self.gemv = None                            # on CUDA the module `kernels_triton.gemv`

    @property
    def linear(self):
        """The projections: on CUDA `gemv.linear` (decode rows; CMOE_GEMV=0: cuBLAS), else F.linear."""
        return self.gemv.linear if self.gemv is not None else F.linear

    def applies(self, h, position_embeddings, attention_mask, past_key_values) -> bool:
        from cmoe.executor.kv import StaticKV
        return (h.dim() == 3 and h.shape[1] == 1 and isinstance(past_key_values, StaticKV)
                and past_key_values.decoding and attention_mask is not None
                and attention_mask.dtype == torch.bool and self.a.layer_idx in past_key_values.keys
                and position_embeddings[0].shape[-1] == self.D)        # a rotary over the whole head

    def __call__(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
        if not self.applies(hidden_states, position_embeddings, attention_mask, past_key_values):
            return self.orig(hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values, **kw)
        B = hidden_states.shape[0]
        qkv = self.linear(hidden_states.reshape(B, -1), self.w, self.b)
        return self._attend(qkv, B, position_embeddings, past_key_values)

    def normed(self, norm, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
        """The module's forward on norm(hidden_states), for a caller that holds the layer's input
        norm and has decided to fold it (`Segments._moe_decoder`, under CMOE_QKV_NORM=1, decided
        once per engine): on CUDA, for one decode row, the norm is folded into the q/k/v GEMV
        (`gemv.gemv(..., norm=)`), one launch fewer; else the norm runs first, as transformers'
        layer runs it."""
        if (self.folds(norm) and self.applies(hidden_states, position_embeddings, attention_mask, past_key_values)):
            x = hidden_states.reshape(hidden_states.shape[0], -1)
            if self.gemv.fits_norm(x, self.w, self.b, norm.weight):
                qkv = self.gemv.gemv(x, self.w, self.b, *self.gemv.config(self.w.shape[0]),
                                     norm=(norm.weight, norm.variance_epsilon))
                return self._attend(qkv, x.shape[0], position_embeddings, past_key_values)
        return self(norm(hidden_states), position_embeddings, attention_mask, past_key_values, **kw)

    def folds(self, norm) -> bool:
        """Whether `normed` can fold `norm` into the q/k/v GEMV: on CUDA (the switches are the
        caller's), for the RMSNorm modules `norm.rms_norm` stands in for."""
        if self.kernels is None or self.gemv is None:      # off CUDA: no Triton to import
            return False
        from cmoe.executor.kernels_triton.norm import NORM_CLASSES
        return type(norm).__name__ in NORM_CLASSES and hasattr(norm, "variance_epsilon")

    def _attend(self, qkv, B, position_embeddings, kv):
        a, D, lin = self.a, self.D, self.linear
        q, k, v = qkv.split([self.nq, self.nk, self.nk], -1)
        if self.norm == "full":
            q, k = a.q_norm(q), a.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.reshape(B, -1, D), k.reshape(B, -1, D), v.reshape(B, -1, D)
        if self.norm == "head":
            q, k = a.q_norm(q), a.k_norm(k)
        cos, sin = (t.reshape(B, D) for t in position_embeddings)
        keys, values = kv.keys[a.layer_idx], kv.values[a.layer_idx]
        if self.kernels is not None:
            o = self.kernels.decode_attention(q, k, v, cos, sin, keys, values, kv.slots, kv.valid, a.scaling)
        else:
            qr = rope_write(q, k, v, cos, sin, keys, values, kv.slots)
            o = attend(qr, keys, values, kv.valid, a.scaling)
        return lin(o, a.o_proj.weight, a.o_proj.bias).reshape(B, 1, -1), None


def install(model, family: str, cuda: bool) -> list:
    """Give each attention module of a covered family the decode step above. Returns what
    `uninstall` needs (the model may be shared with the reference engine). Families it does not
    cover, or CMOE_FAST_ATTN=0: nothing changes."""
    if family not in FAMILIES or not enabled():
        return []
    if getattr(model.config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return []                                   # the kernel rotates the whole head
    kernels, gemv = None, None
    if cuda:
        from cmoe.executor.kernels_triton import attention as kernels
        from cmoe.executor.kernels_triton import gemv
    done = []
    for layer in model.model.layers:
        fd = getattr(layer.self_attn, "_cmoe_fast", None)     # an earlier engine's, on the same model
        if fd is None:
            fd = layer.self_attn._cmoe_fast = FastDecode(layer.self_attn, FAMILIES[family])
        fd.kernels, fd.gemv = kernels, gemv
        layer.self_attn.forward = fd
        done.append(fd)
    return done


def uninstall(done: list) -> None:
    for fd in done:
        if "forward" in fd.a.__dict__:
            del fd.a.forward
