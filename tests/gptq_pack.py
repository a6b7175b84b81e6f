"""Group-wise asymmetric weight quantization in numpy, packed the GPTQ way.

Used to write quantized checkpoints (tests, and users who want to see exact sizes of a format)
and to check accuracy against a float reference. A column of `in` b-bit values is one
little-endian bit stream packed into int32 words, which is GPTQ's layout for 2, 4 and 8 bits and
the natural continuation for 3 bits. Legend: O out features, I in features, G groups = I / group.
"""

from __future__ import annotations

import numpy as np


def quantize(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [O, I] float -> q [I, O] uint8 codes, scales [G, O] float16, zeros [G, O] uint8."""
    O, I = w.shape
    assert I % group == 0, f"in features {I} must be a multiple of the group size {group}"
    g = w.T.reshape(I // group, group, O).astype(np.float32)          # [G, group, O]
    lo, hi = g.min(1), g.max(1)                                        # [G, O]
    qmax = 2 ** bits - 1
    scale = np.where(hi > lo, (hi - lo) / qmax, 1.0).astype(np.float16)
    zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, qmax).astype(np.uint8)
    q = np.clip(np.round(g / scale[:, None].astype(np.float32)) + zero[:, None], 0, qmax)
    return q.reshape(I, O).astype(np.uint8), scale, zero


def dequantize(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int) -> np.ndarray:
    """Inverse of quantize: -> w [O, I] float32."""
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


def gptq_tensors(w: np.ndarray, bits: int, group: int) -> dict[str, np.ndarray]:
    """The tensors a GPTQ-style checkpoint stores for one linear layer of weight w [O, I]."""
    q, scale, zero = quantize(w, bits, group)
    I = w.shape[1]
    return {"qweight": pack_bits(q, bits),                               # [I*b/32, O]
            "qzeros": pack_bits(zero.T, bits).T.copy(),                   # [G, O*b/32]
            "scales": scale,                                              # [G, O]
            "g_idx": (np.arange(I) // group).astype(np.int32)}            # [I]


def gptq_dequantize(t: dict[str, np.ndarray], bits: int, group: int, out: int) -> np.ndarray:
    I = t["g_idx"].shape[0]
    q = unpack_bits(t["qweight"], bits, I)
    zero = unpack_bits(t["qzeros"].T.copy(), bits, out).T
    return dequantize(q, t["scales"], zero, group)
