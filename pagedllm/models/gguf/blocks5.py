"""The 5-bit GGUF block types (Q5_0, Q5_1, Q5_K: what Q4_K_M / Q5_K_M files hold besides
Q4_K, Q6_K, Q8_0) -> (q, s, m) per row, w = q s + m, the contract of
layers/quantization/gguf.py's gguf_tensor_quantized: q int8 [R, K] (0..31, or -16..15 for
Q5_0), s and m float32 [R, K/32] (m None: no mins). Every 5-bit value fits int8, so these
tensors take the int8 layout in groups of 32, exactly.
"""
from __future__ import annotations

import numpy as np


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """qh [..., count/8] little-endian bit fields -> [..., count] of 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, count=count, bitorder="little")


def _legacy5(data: np.ndarray, with_min: bool):
    """Q5_0 (d, qh[4], qs[16]: w = d (q - 16)) and Q5_1 (d, m, qh, qs: w = d q + m); element j
    of a block of 32: low nibble of qs[j] (j < 16) or high nibble of qs[j - 16], bit j of qh."""
    rows = data.shape[0]
    b = data.reshape(rows, -1, 24 if with_min else 22)
    d = _f16(b[:, :, 0:2])
    qh = b[:, :, 4:8] if with_min else b[:, :, 2:6]
    qs = b[:, :, -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2) | (_bits(qh, 32) << 4)   # [R, NB, 32] 0..31
    if with_min:
        return q.astype(np.int8).reshape(rows, -1), d, _f16(b[:, :, 2:4])
    return (q.astype(np.int8) - 16).reshape(rows, -1), d, None


def k_scales(sc: np.ndarray):
    """The 12 scale bytes of a Q4_K / Q5_K block [..., 12] -> (scales, mins) [..., 8], 6 bits each."""
    lo, hi, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (top >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scale, mins


def q5_k(data: np.ndarray):
    """Q5_K: 256 per block (d, dmin, 12 scale bytes, qh[32], qs[128]); sub-block 2c takes the low
    nibbles of qs run c, 2c + 1 the high ones; bit i of qh[j] is the fifth bit of sub-block i's j."""
    rows = data.shape[0]
    b = data.reshape(rows, -1, 176)
    nb = b.shape[1]
    d, dmin = _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4])
    scale, mins = k_scales(b[:, :, 4:16])
    qh = b[:, :, 16:48]                                       # [R, NB, 32]
    qs = b[:, :, 48:].reshape(rows, nb, 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, nb, 8, 32)
    high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(rows, -1)
    s = (d[:, :, None] * scale.astype(np.float32)).reshape(rows, -1)
    m = -(dmin[:, :, None] * mins.astype(np.float32)).reshape(rows, -1)
    return q, s, m


DECODERS5 = {"Q5_0": lambda x: _legacy5(x, False), "Q5_1": lambda x: _legacy5(x, True), "Q5_K": q5_k}
