"""Quantizers for the K block types the gguf package only dequantises (Q4_K, Q5_K, Q6_K), for
the random-weight writer: plain round-to-nearest on 6-bit (Q6_K: 8-bit) sub-block scales, not
llama.cpp's searched scales; the bytes are llama.cpp's block layouts (ggml-common.h), checked
against gguf.quants.dequantize in the tests. Rows [R, K] float32, K a multiple of 256 ->
[R, K/256 * block bytes] uint8.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# Scales are rounded up so the largest value of a sub-block never clips: f16 rounding of the
# super-block scale is covered by this margin (f16 keeps 11 bits).
MARGIN = 1 + 2.0**-9


def _f16_up(x: np.ndarray) -> np.ndarray:
    return (x * MARGIN).astype(np.float16)


def _ceil_codes(need: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """ceil(need / unit) in 0..top, 0 where unit is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(unit > 0, np.ceil(need / unit), 0)
    return np.clip(codes, 0, top).astype(np.uint8)


def _pack_k_scales(scale: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [..., 8] -> llama.cpp's 12 bytes (get_scale_min_k4's inverse)."""
    lo = scale[..., :4] | ((scale[..., 4:] >> 4) << 6)
    hi = mins[..., :4] | ((mins[..., 4:] >> 4) << 6)
    top = (scale[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)
    return np.concatenate([lo, hi, top], axis=-1).astype(np.uint8)


def _k_affine(x: np.ndarray, levels: int):
    """x [B, 8, 32] -> (d, dmin f16 [B], scales, mins uint8 [B, 8], q uint8 [B, 8, 32] 0..levels):
    w = d sc q - dmin mn, with mn dmin >= -min(x, 0) and d sc levels >= max + mn dmin."""
    need_min = np.maximum(0, -x.min(axis=-1))  # [B, 8]
    dmin = _f16_up(need_min.max(axis=-1) / 63)  # [B]
    mins = _ceil_codes(need_min, dmin.astype(np.float32)[:, None], 63)
    offset = mins * dmin.astype(np.float32)[:, None]  # [B, 8]
    need_step = (x.max(axis=-1) + offset) / levels
    d = _f16_up(need_step.max(axis=-1) / 63)
    scale = _ceil_codes(need_step, d.astype(np.float32)[:, None], 63)
    step = scale * d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    return d, dmin, scale, mins, np.clip(q, 0, levels).astype(np.uint8)


def _blocks(rows: np.ndarray) -> np.ndarray:
    r, k = rows.shape
    if k % QK_K:
        raise ValueError(f"a K-quant row has a multiple of {QK_K} values, got {k}")
    return rows.astype(np.float32).reshape(-1, QK_K)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 8, 32] 0..15 -> 4 runs of 32 bytes: sub-block 2c low nibbles, 2c + 1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    x = _blocks(rows).reshape(-1, 8, 32)
    d, dmin, scale, mins, q = _k_affine(x, 15)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(scale, mins), _nibbles(q)],
        axis=1,
    )
    return out.reshape(rows.shape[0], -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    x = _blocks(rows).reshape(-1, 8, 32)
    d, dmin, scale, mins, q = _k_affine(x, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # [B, 32]
    out = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_k_scales(scale, mins),
            qh,
            _nibbles(q & 15),
        ],
        axis=1,
    )
    return out.reshape(rows.shape[0], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16, int8 scales: w = d sc (q - 32), q 0..63."""
    x = _blocks(rows).reshape(-1, 16, 16)
    need_step = np.abs(x).max(axis=-1) / 31  # [B, 16]
    d = _f16_up(need_step.max(axis=-1) / 127)
    scale = _ceil_codes(need_step, d.astype(np.float32)[:, None], 127)
    step = scale * d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128: 4 runs of 32
    ql = np.concatenate(
        [(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2
    ).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)).reshape(
        -1, 64
    )
    out = np.concatenate([ql, qh, scale.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(rows.shape[0], -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
