"""GGUF blocks -> the row-interleaved layout of csrc/gguf_linear.cpp (its header describes it).

A tensor's raw rows [N, row bytes] (one GGUF type) are decoded with numpy into per-row fields
(float16 d / m / dmin kept as their bits, 8-bit sub-block scales) and integer codes [N, K], then
written out in groups of 16 rows (the last padded with zero rows): nothing is widened, so a row
holds the file's bytes (Q4_K / Q5_K: 4 more for 144 / 176, their 6-bit scales as bytes). A weight is a list of
such segments (a fused QKV may mix types), described by `meta` [groups, 4] int64: byte offset,
GGML type, first output row, rows.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.models.layers.quantization.weight_pages import mapped_bytes

GROUP = 16  # rows a group
QB = 32  # features a block
UNIT = {"int8": 4, "int16": 2}  # activations -> features of a row a code unit (quads, pairs)
QUADS = 256  # added to a group's type in meta: codes in quads
TYPE_IDS = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}  # gguf.GGMLQuantizationType
BLOCK = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}  # (features, bytes) a block


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one GGUF row of k features; ValueError for a type or width without a kernel."""
    if type_name not in BLOCK:
        raise ValueError(f"GGUF type {type_name} has no quantized kernel (supported: {', '.join(BLOCK)})")
    feats, nbytes = BLOCK[type_name]
    if k % feats:
        raise ValueError(f"a {type_name} row of {k} features is not whole blocks of {feats}")
    return k // feats * nbytes


def _f16_bits(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] uint16 (a float16's bits)."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: byte i holds code i (low) and code i + 16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 8 n] bits, little-endian (bit j of byte j / 8)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scales(sc: np.ndarray):
    """The 12 scale bytes of a Q4_K / Q5_K block [..., 12] -> (scales, mins) [..., 8], 6 bits each."""
    lo, hi, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    return (
        np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1),
        np.concatenate([hi & 63, (top >> 4) | ((hi >> 6) << 4)], axis=-1),
    )


def decode(data: np.ndarray, type_name: str) -> dict:
    """Raw rows [N, row bytes] -> {"codes": [N, K] (uint8, Q8_0 int8), per-row fields [N, S(, j)]}."""
    n = data.shape[0]
    b = data.reshape(n, -1, BLOCK[type_name][1])
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # d, (m), (qh: bit j = code j's 16), qs
        with_m = type_name.endswith("_1")
        codes = _nibbles(b[:, :, -16:])
        if type_name.startswith("Q5"):
            at = 4 if with_m else 2
            codes = codes | (_bits(b[:, :, at : at + 4]) << 4)
        out = {"d": _f16_bits(b[:, :, 0:2]), "codes": codes.reshape(n, -1)}
        if with_m:
            out["m"] = _f16_bits(b[:, :, 2:4])
        return out
    if type_name == "Q8_0":
        return {"d": _f16_bits(b[:, :, 0:2]), "codes": b[:, :, 2:].view(np.int8).reshape(n, -1)}
    if type_name in ("Q4_K", "Q5_K"):  # d, dmin, scales [12], (Q5_K: qh [32]), qs [128]
        scale, mn = _k_scales(b[:, :, 4:16])  # [N, S, 8]
        qs = b[:, :, -128:].reshape(n, -1, 4, 1, 32)  # 4 runs of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if type_name == "Q5_K":  # bit j of qh[l]: element l of sub-block j
            codes = codes | (_bits(b[:, :, 16:48]).reshape(n, -1, 32, 8).swapaxes(2, 3) << 4)
        return {
            "d": _f16_bits(b[:, :, 0:2]),
            "dmin": _f16_bits(b[:, :, 2:4]),
            "sc": scale,
            "mn": mn,
            "codes": codes.reshape(n, -1),
        }
    # Q6_K: ql [128], qh [64], scales int8 [16], d; each half of 128 features in 4 runs of 32
    # (llama.cpp's dequantize_row_q6_K)
    s = b.shape[1]
    ql = b[:, :, 0:128].reshape(n, s, 2, 64)
    qh = b[:, :, 128:192].reshape(n, s, 2, 32)
    codes = np.stack(
        [
            (ql[..., :32] & 15) | ((qh & 3) << 4),
            (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
            (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4),
        ],
        axis=3,
    )  # [N, S, 2, 4, 32], 0..63 (the value is code - 32)
    return {"d": _f16_bits(b[:, :, 208:210]), "sc": b[:, :, 192:208], "codes": codes.reshape(n, -1)}


def _by_row(a: np.ndarray, g: int) -> np.ndarray:
    """A per-row field [N, S, (j)] -> bytes [G, S, j * 16 * itemsize]: each (super-block,
    sub-block) an array of the group's 16 rows."""
    a = a.reshape(g, GROUP, a.shape[1], -1).transpose(0, 2, 3, 1)  # [G, S, j, 16]
    return np.ascontiguousarray(a).view(np.uint8).reshape(g, a.shape[1], -1)


def _units(codes: np.ndarray, g: int, w: int) -> np.ndarray:
    """codes [N, K] -> [G, K/32, 32/w units, 16 w]: byte w i + j of unit u = row i, feature w u + j
    (w = 2: pairs, the int16 activations' layout; 4: quads, the int8 ones')."""
    return codes.reshape(g, GROUP, -1, QB // w, w).transpose(0, 2, 3, 1, 4).reshape(g, -1, QB // w, w * GROUP)


def _u4_chunks(codes: np.ndarray, g: int, w: int) -> np.ndarray:
    """4-bit codes -> [G, K/32, 256]: of U units, chunk c = unit c (low nibbles) | unit c + U/2 (high)."""
    p = _units(codes, g, w)
    half = p.shape[2] // 2
    return (p[:, :, :half] | (p[:, :, half:] << 4)).reshape(p.shape[0], p.shape[1], -1)


def _u2_chunks(high: np.ndarray, g: int, w: int) -> np.ndarray:
    """2-bit codes -> [G, K/32, 128]: of U units, chunk c, bits 2f..2f+1 = unit c + (U/4) f."""
    p = _units(high, g, w)
    p = p.reshape(g, p.shape[1], 4, p.shape[2] // 4, -1)  # [G, B, f, c, 16 w]
    return (p[:, :, 0] | (p[:, :, 1] << 2) | (p[:, :, 2] << 4) | (p[:, :, 3] << 6)).reshape(g, p.shape[1], -1)


def _u1_chunks(high: np.ndarray, g: int, w: int) -> np.ndarray:
    """1-bit codes -> [G, K/32, 64]: of U units, chunk c, bit f = unit c + (U/8) f."""
    p = _units(high, g, w)
    p = p.reshape(g, p.shape[1], 8, p.shape[2] // 8, -1)  # [G, B, f, c, 16 w]
    return sum(p[:, :, f] << f for f in range(8)).astype(np.uint8).reshape(g, p.shape[1], -1)


def _q6_quads(codes: np.ndarray, g: int) -> np.ndarray:
    """Q6_K's 6-bit codes in quads -> [G, K/32, 384]: each half-block's quads 4h..4h+3 (one
    sub-scale) as 3 chunks, quad 4h + i's codes (i < 3) in bits 0-5 of chunk 3h + i, bits 2i..2i+1
    of quad 4h + 3's in bits 6-7 (so three quads are one `and` each, the fourth 8 ops on AVX2)."""
    p = _units(codes, g, 4).reshape(g, -1, 2, 4, 4 * GROUP)  # [G, B, half, quad, 64]
    top = p[:, :, :, 3:4] >> np.array([0, 2, 4], dtype=np.uint8)[:, None]  # [G, B, half, 3, 64]
    return (p[:, :, :, :3] | ((top & 3) << 6)).reshape(g, p.shape[1], -1)


def repack(data: np.ndarray, type_name: str, activations: str = "int8") -> np.ndarray:
    """One type's raw rows [N, row bytes] -> the groups' bytes [ceil(N / 16), group bytes], codes
    in quads (int8 activations) or pairs (int16)."""
    w = UNIT[activations]
    n = data.shape[0]
    g = -(-n // GROUP)
    if g * GROUP != n:  # zero rows: zero scales and codes, an output of 0 that is not stored
        data = np.concatenate([data, np.zeros((g * GROUP - n, data.shape[1]), dtype=np.uint8)])
    f = decode(data, type_name)
    codes = f["codes"].view(np.uint8)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        parts = [_by_row(f["d"], g)] + ([_by_row(f["m"], g)] if "m" in f else [])
        parts.append(_u4_chunks(codes & 15, g, w))
        if type_name.startswith("Q5"):
            parts.append(_u1_chunks(codes >> 4, g, w))
    elif type_name == "Q8_0":
        parts = [_by_row(f["d"], g), _units(codes, g, w).reshape(g, -1, 512)]
    else:
        s = f["d"].shape[1]
        if type_name in ("Q4_K", "Q5_K"):
            parts = [
                _by_row(f["d"], g),
                _by_row(f["dmin"], g),
                _by_row(f["sc"], g),
                _by_row(f["mn"], g),
                _u4_chunks(codes & 15, g, w).reshape(g, s, -1),
            ]
            if type_name == "Q5_K":
                parts.append(_u1_chunks(codes >> 4, g, w).reshape(g, s, -1))
        else:
            parts = [_by_row(f["d"], g), _by_row(f["sc"], g)]
            if w == 4:
                parts.append(_q6_quads(codes, g).reshape(g, s, -1))
            else:
                parts += [
                    _u4_chunks(codes & 15, g, w).reshape(g, s, -1),
                    _u2_chunks(codes >> 4, g, w).reshape(g, s, -1),
                ]
    return np.concatenate(parts, axis=2).reshape(g, -1)


def pack_segments(segments, activations: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """[(type name, raw rows [n, row bytes])] in output-row order -> (packed uint8 [bytes],
    meta int64 [groups, 4]) as gguf_linear takes them, for int8 or int16 activations."""
    if activations not in UNIT:
        raise ValueError(f"GGUF activations must be one of {', '.join(UNIT)}, not {activations!r}")
    blobs, meta, offset, row = [], [], 0, 0
    for type_name, data in segments:
        groups = repack(data, type_name, activations)
        type_id = TYPE_IDS[type_name] + (QUADS if activations == "int8" else 0)
        for i in range(groups.shape[0]):
            meta.append((offset + i * groups.shape[1], type_id, row + i * GROUP, min(GROUP, data.shape[0] - i * GROUP)))
        blobs.append(groups.reshape(-1))
        offset += groups.size
        row += data.shape[0]
    packed = np.concatenate(blobs, out=mapped_bytes(offset))  # huge pages whatever malloc's state
    return torch.from_numpy(packed), torch.tensor(meta, dtype=torch.int64)
