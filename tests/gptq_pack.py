"""Group-wise weight quantization in numpy, packed the GPTQ way and the AWQ (gemm) way.

Used to write quantized checkpoints (tests, and users who want to see exact sizes of a format)
and to check accuracy against a float reference. Legend: O out features, I in features,
G groups = I / group; w = (q - z) * s per group, q and z integers in 0..2**b - 1, s fp16.

- GPTQ: a column of `in` b-bit values is one little-endian bit stream packed into int32 words
  (qweight [I*b/32, O]; for 4 bits in-feature 8r + k sits at bits 4k of row r), which is GPTQ's
  layout for 2, 4 and 8 bits and the natural continuation for 3 bits; qzeros [G, O*b/32] packs
  each group's zero points the same way along the outputs. Its original layout ("gptq", what
  AutoGPTQ and GPTQModel save) stores z - 1, wrapped to b bits (a stored 2**b - 1 reads back as
  z = 2**b); "gptq_v2" stores z.
- AWQ gemm (4 bits): qweight [I, O/8] and qzeros [G, O/8], nibble k of word j holding output
  8j + (0, 2, 4, 6, 1, 3, 5, 7)[k]; scales [G, O].
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble k of an AWQ word holds output 8j + AWQ_ORDER[k]


def quantize(w: np.ndarray, bits: int, group: int, sym: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [O, I] float -> q [I, O] uint8 codes, scales [G, O] float16, zeros [G, O] uint8. sym: the
    zero point is 2**(b-1) and the scale covers the larger magnitude (GPTQ's sym=True)."""
    O, I = w.shape
    assert I % group == 0, f"in features {I} must be a multiple of the group size {group}"
    g = w.T.reshape(I // group, group, O).astype(np.float32)          # [G, group, O]
    lo, hi = g.min(1), g.max(1)                                        # [G, O]
    qmax = 2 ** bits - 1
    if sym:
        scale = (np.maximum(np.abs(lo), np.abs(hi)) * 2 / qmax).astype(np.float16)
        scale = np.where(scale > 0, scale, np.float16(1))
        zero = np.full(scale.shape, 2 ** (bits - 1), np.uint8)
    else:
        scale = np.where(hi > lo, (hi - lo) / qmax, 1.0).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, qmax).astype(np.uint8)
    q = np.clip(np.round(g / scale[:, None].astype(np.float32)) + zero[:, None], 0, qmax)
    return q.reshape(I, O).astype(np.uint8), scale, zero


def dequantize(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int) -> np.ndarray:
    """Inverse of quantize: -> w [O, I] float32, (q - z) * s exactly (no rounding in fp32)."""
    I, O = q.shape
    g = q.reshape(I // group, group, O).astype(np.float32) - zero[:, None].astype(np.float32)
    return (g * scale[:, None].astype(np.float32)).reshape(I, O).T


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [N, C] (values < 2**bits) -> int32 [ceil(N*bits/32), C], each column a bit stream."""
    N, C = codes.shape
    stream = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = stream.transpose(1, 0, 2).reshape(C, N * bits)                 # [C, N*bits]
    words = -(-N * bits // 32)
    stream = np.pad(stream, ((0, 0), (0, words * 32 - N * bits)))
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.int32).T.copy()


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of pack_bits: int32 [W, C] -> codes [n, C] uint8."""
    stream = np.unpackbits(packed.T.copy().view(np.uint8), axis=-1, bitorder="little")[:, : n * bits]
    C = packed.shape[1]
    vals = stream.reshape(C, n, bits) * (1 << np.arange(bits, dtype=np.uint16))
    return vals.sum(-1).astype(np.uint8).T


def gptq_tensors(w: np.ndarray, bits: int, group: int, sym: bool = False,
                 checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """The tensors a GPTQ checkpoint stores for one linear layer of weight w [O, I] (desc_act off)."""
    q, scale, zero = quantize(w, bits, group, sym)
    I = w.shape[1]
    stored = zero if checkpoint_format == "gptq_v2" else (zero.astype(np.int16) - 1) & (2 ** bits - 1)
    return {"qweight": pack_bits(q, bits),                               # [I*b/32, O]
            "qzeros": pack_bits(stored.T.astype(np.uint8), bits).T.copy(),  # [G, O*b/32]
            "scales": scale,                                              # [G, O]
            "g_idx": (np.arange(I) // group).astype(np.int32)}            # [I]


def gptq_dequantize(t: dict[str, np.ndarray], bits: int, group: int, out: int,
                    checkpoint_format: str = "gptq") -> np.ndarray:
    I = t["g_idx"].shape[0]
    q = unpack_bits(t["qweight"], bits, I)
    zero = unpack_bits(t["qzeros"].T.copy(), bits, out).T.astype(np.int16)
    return dequantize(q, t["scales"], zero + (checkpoint_format != "gptq_v2"), group)


def _awq_pack(v: np.ndarray) -> np.ndarray:
    """[R, O] 4-bit values -> int32 [R, O/8] in AWQ's nibble order."""
    R, O = v.shape
    v = v.astype(np.uint32).reshape(R, O // 8, 8)[..., list(AWQ_ORDER)]
    return (v << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)


def awq_tensors(w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """The tensors an AWQ (gemm, 4-bit, zero point) checkpoint stores for one linear of weight w [O, I]."""
    q, scale, zero = quantize(w, 4, group)
    return {"qweight": _awq_pack(q), "qzeros": _awq_pack(zero), "scales": scale}      # [I, O/8], [G, O/8], [G, O]


def awq_dequantize(t: dict[str, np.ndarray], group: int) -> np.ndarray:
    def unpack(p):
        nib = (p.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15    # [R, O/8, 8]
        return nib[..., list(np.argsort(AWQ_ORDER))].reshape(p.shape[0], -1)
    return dequantize(unpack(t["qweight"]), t["scales"], unpack(t["qzeros"]), group)
