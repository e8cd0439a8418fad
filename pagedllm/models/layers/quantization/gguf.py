"""A GGUF file served as it is: `--model FILE.gguf` (or `--quantization gguf` for the default
model's shipped Q4_1 file).

The config and tokenizer (with the chat template) come from the file's metadata through the
gguf package (models/gguf/: every registered architecture), saved once into a small directory
under $PAGEDLLM_HOME/gguf (`gguf_model_dir`), which names the file in gguf.json; the rest of
the engine reads that directory as any model directory. The weights are read from the file itself (`iter_weights`):
each linear's blocks are repacked, without loss, into the engine's int4 or int8 layout
(layouts.py) and loaded as one uint8 row blob per output row, [N, K/C, chunk bytes] (a chunk of
C features: its integers, then its scale and min as float32), so the layers' weight loaders
cut and fuse rows as they do float weights; `process_weights_after_loading` splits the blob.
- Q4_0 (w = d (q - 8)), Q4_1 (d q + m): the int4 layout's own bytes, s = d, m = -8d / m.
- Q4_K: 32-feature sub-blocks, s = d sc, m = -dmin mn (6-bit sc, mn): int4, groups of 32.
- Q8_0: int8, groups of 32, s = d. Q6_K: int8 (q - 32), 16-feature sub-blocks, s = d sc.
- Q5_0, Q5_1, Q5_K: int8 (0..31, or q - 16), groups of 32 (models/gguf/blocks5.py).
Every product is exact in float32, so q s + m is the gguf package's dequantised value.
One layout a file: int4 (groups of 32) when every linear is 4-bit; else int8 in groups of 16
(Q6_K present) or 32, the 4-bit tensors widened. The token embedding is dequantised (a lookup
table); a tied LM head re-quantizes it to int8 in groups of 32 (exact for a Q8_0 embedding).
Tensor names, and what llama.cpp's converter did to a tensor, are models/gguf/tensor_names.py's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedllm.models.gguf.blocks5 import DECODERS5
from pagedllm.models.gguf.weights import gguf_weights, is_quantized_linear
from pagedllm.models.layers.quantization.gguf_dir import GGUF_MARKER as MARKER
from pagedllm.models.layers.quantization.gguf_dir import is_gguf_dir
from pagedllm.models.layers.quantization.base import QuantizedLinearMethod, set_quantized
from pagedllm.models.layers.quantization.int8 import LM_HEAD_GROUP, Int8LinearMethod
from pagedllm.models.layers.quantization.layouts import pack_int4

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q6_K") + tuple(DECODERS5)


def gguf_info(model_dir) -> dict:
    """gguf.json: {"gguf_file": path, "tensor_types": {name: GGML type name}}."""
    with open(os.path.join(str(model_dir), MARKER)) as f:
        return json.load(f)


def gguf_model_dir(gguf_path: Path, home: Path) -> Path:
    """The directory (config, tokenizer, gguf.json) of a GGUF file, made once (atomically) under
    home/gguf, keyed by the file's path, size and mtime."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = home / "gguf" / f"{gguf_path.stem}-{key}"
    if is_gguf_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        _write_model_dir(gguf_path, tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_model_dir(gguf_path: Path, out: Path) -> None:
    from pagedllm.models.gguf.model_dir import write_model_dir
    write_model_dir(gguf_path, out, MARKER, tuple(DECODERS))


# --- blocks -> (q, s, m) per row: q [R, K] integers (uint8 0..15 or int8), s, m [R, K/C] float32

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _split_blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return data.reshape(rows, -1, block_bytes)


def _q4_legacy(data: np.ndarray, with_min: bool):
    b = _split_blocks(data, 20 if with_min else 18)
    d = _f16(b[:, :, 0:2])
    m = _f16(b[:, :, 2:4]) if with_min else -8 * d
    qs = b[:, :, -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(data.shape[0], -1)
    return q, d, m


def _q8_0(data: np.ndarray):
    b = _split_blocks(data, 34)
    return b[:, :, 2:].view(np.int8).reshape(data.shape[0], -1), _f16(b[:, :, 0:2]), None


def _q4_k(data: np.ndarray):
    b = _split_blocks(data, 144)
    rows, nb = b.shape[:2]
    d, dmin, sc, qs = _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]), b[:, :, 4:16], b[:, :, 16:]
    lo, hi = sc[:, :, 0:4], sc[:, :, 4:8]
    scale = np.concatenate([lo & 63, (sc[:, :, 8:12] & 15) | ((lo >> 6) << 4)], axis=2)   # [R, NB, 8]
    mn = np.concatenate([hi & 63, (sc[:, :, 8:12] >> 4) | ((hi >> 6) << 4)], axis=2)
    qs = qs.reshape(rows, nb, 4, 1, 32)   # 4 runs of 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, -1)
    s = (d[:, :, None] * scale.astype(np.float32)).reshape(rows, -1)
    m = -(dmin[:, :, None] * mn.astype(np.float32)).reshape(rows, -1)
    return q, s, m


def _q6_k(data: np.ndarray):
    b = _split_blocks(data, 210)
    rows, nb = b.shape[:2]
    ql = b[:, :, 0:128].reshape(rows, nb, 2, 64)
    qh = b[:, :, 128:192].reshape(rows, nb, 2, 32)
    sc = b[:, :, 192:208].view(np.int8)
    d = _f16(b[:, :, 208:210])
    # Each half of 128: 4 runs of 32 (llama.cpp's dequantize_row_q6_K).
    q = np.stack([(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                  (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)],
                 axis=3)   # [R, NB, 2, 4, 32]
    q = (q.astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
    s = (d[:, :, None] * sc.astype(np.float32)).reshape(rows, -1)
    return q, s, None


DECODERS = {"Q4_0": lambda x: _q4_legacy(x, False), "Q4_1": lambda x: _q4_legacy(x, True),
            "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k, **DECODERS5}


def gguf_tensor_quantized(data: np.ndarray, type_name: str):
    """A GGUF tensor's raw blocks [rows, row bytes] -> (q [rows, K], s, m [rows, K/G]) with
    w = q s + m (m None: no mins) — the gguf package's dequantised values, exactly."""
    if type_name not in DECODERS:
        raise ValueError(f"GGUF type {type_name} is not served as it is "
                         f"(supported: {', '.join(DECODERS)}, and F32/F16 norms)")
    return DECODERS[type_name](data)


class GGUFLayout:
    """The engine layout a file's linears are repacked into: int4 in groups of 32 or int8 in
    groups of `group` (16 or 32); one chunk of the row blob is one group."""

    def __init__(self, int4: bool, group: int) -> None:
        self.int4, self.group = int4, group
        self.q_bytes = group // 2 if int4 else group
        self.chunk_bytes = self.q_bytes + 8   # + scale, min (float32)

    def blob(self, q: np.ndarray, s: np.ndarray, m) -> np.ndarray:
        """(q, s, m) of gguf_tensor_quantized -> [rows, K/G, chunk bytes] uint8."""
        rows, k = q.shape
        reps = (k // s.shape[1]) // self.group   # each source group is `reps` of ours
        s = np.repeat(s, reps, axis=1).astype(np.float32)
        m = np.zeros_like(s) if m is None else np.repeat(m, reps, axis=1).astype(np.float32)
        if self.int4:
            qb = pack_int4(torch.from_numpy(np.ascontiguousarray(q))).numpy()
        else:
            qb = q.astype(np.int8).view(np.uint8)
        qb = qb.reshape(rows, -1, self.q_bytes)
        return np.concatenate([qb, s.view(np.uint8).reshape(rows, -1, 4),
                               m.view(np.uint8).reshape(rows, -1, 4)], axis=2)

    def split(self, blob: torch.Tensor):
        """[N, K/G, chunk bytes] -> (qweight, scales, mins) as quant_linear takes them."""
        n = blob.shape[0]
        q = blob[:, :, :self.q_bytes].reshape(n, -1)
        s = blob[:, :, self.q_bytes:self.q_bytes + 4].contiguous().view(torch.float32).reshape(n, -1)
        m = blob[:, :, self.q_bytes + 4:].contiguous().view(torch.float32).reshape(n, -1)
        return (q if self.int4 else q.view(torch.int8)), s, m


class GGUFLinearMethod(QuantizedLinearMethod):
    """The weight is the row blob (GGUFLayout), loaded by the layer's own weight loader."""

    def __init__(self, layout: GGUFLayout) -> None:
        super().__init__()
        self.layout = layout

    def create_weights(self, layer, input_size, output_size):
        if input_size % self.layout.group:
            raise ValueError(f"a GGUF linear's input size {input_size} is not whole blocks")
        shape = (output_size, input_size // self.layout.group, self.layout.chunk_bytes)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)

    def process_weights_after_loading(self, layer):
        set_quantized(layer, *self.layout.split(layer.weight.detach()))


class GGUFConfig:
    name = "gguf"

    def __init__(self, path: str, types: dict) -> None:
        self.path, self.types = path, types   # tensor name -> GGML type name
        linear = {t for n, t in types.items() if is_quantized_linear(n)}
        bad = linear - set(INT4_TYPES) - set(INT8_TYPES)
        if bad:
            raise ValueError(f"GGUF file {path}: linear weights of type {', '.join(sorted(bad))} are not "
                             f"served as they are (supported: {', '.join(INT4_TYPES + INT8_TYPES)})")
        if linear <= set(INT4_TYPES):
            self.layout = GGUFLayout(True, 32)
        else:
            self.layout = GGUFLayout(False, 16 if "Q6_K" in linear else 32)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "GGUFConfig":
        info = gguf_info(model_dir)
        return cls(info["gguf_file"], info["tensor_types"])

    def get_linear_method(self, lm_head: bool = False):
        if lm_head:
            # A tied head quantizes the (dequantised) embedding; an untied one's output.weight
            # is dequantised by iter_weights too (its type may differ from the layers').
            return Int8LinearMethod(LM_HEAD_GROUP, offset=False)
        return GGUFLinearMethod(self.layout)

    def iter_weights(self, model_dir: str):
        """(HF name, tensor): norms and the embedding (and an untied head) as float32, each
        linear as its row blob in self.layout, Q and K rows in HF's order."""
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        return gguf_weights(self.path, hf, lambda data, type_name: self.layout.blob(
            *gguf_tensor_quantized(data, type_name)))
