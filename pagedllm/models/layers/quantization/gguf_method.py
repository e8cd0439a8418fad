"""A GGUF file's quantized tensors held in their own blocks: the linears, the LM head and the
token embedding (rows dequantised when looked up).

Loading: each GGUF row arrives as a row blob [rows, width] uint8 (`row_blob`): its GGML type
number, the row's bytes as in the file, zero padding to the widest row type of the file at that
width, so the layers' weight loaders cut and fuse rows as they do float rows (a fused QKV may
mix Q4_K and Q6_K rows); a row-parallel rank takes its blocks of each row (`input_slice`,
models/gguf/tp_split.py). `process_weights_after_loading` repacks each run of one type into
csrc/gguf_linear.cpp's layout (gguf_repack.py; codes in quads or pairs as
$PAGEDLLM_GGUF_ACTIVATIONS, int8 or int16, says) and holds `qweight` (the bytes) and `scales` (the
int64 group table, where the decode loop looks for a quantized linear's second tensor). A tied
LM head and the embedding share one packed weight. Without the C++ extension: the dequantised
float32 weight (the gguf package's) and torch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.models.gguf.tp_split import slice_row_blobs
from pagedllm.models.layers.quantization.base import QuantizedLinearMethod
from pagedllm.models.layers.quantization.gguf_repack import BLOCK, TYPE_IDS, pack_segments, row_bytes

TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}


def blob_width(types, k: int) -> int:
    """Bytes a row blob of k features takes in a file of these quantized types (those whose
    blocks divide k: llama.cpp gives a 576-wide tensor no 256-feature type)."""
    fits = [t for t in types if k % BLOCK[t][0] == 0]
    if not fits:
        raise ValueError(f"no quantized type of this GGUF file ({', '.join(types)}) has whole blocks in {k} features")
    return 1 + max(row_bytes(t, k) for t in fits)


def row_blob(data: np.ndarray, type_name: str, types) -> np.ndarray:
    """A GGUF tensor's raw rows [rows, row bytes] -> [rows, width] uint8 (type, bytes, padding),
    width that of every row of these features in a file of these quantized types."""
    feats, nbytes = BLOCK[type_name]
    blob = np.zeros((data.shape[0], blob_width(types, data.shape[1] // nbytes * feats)), dtype=np.uint8)
    blob[:, 0] = TYPE_IDS[type_name]
    blob[:, 1 : 1 + data.shape[1]] = data
    return blob


def _segments(blob: np.ndarray, k: int):
    """Row blob [N, width] -> [(type name, raw rows)] for each run of rows of one type."""
    ids = blob[:, 0]
    cuts = [0] + [int(i) + 1 for i in np.flatnonzero(ids[1:] != ids[:-1])] + [len(ids)]
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if int(ids[a]) not in TYPE_NAMES:
            raise ValueError(f"GGUF rows {a}..{b - 1} of a weight were never loaded (type byte {ids[a]})")
        name = TYPE_NAMES[int(ids[a])]
        out.append((name, blob[a:b, 1 : 1 + row_bytes(name, k)]))
    return out


def _dequantized(segments) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(
        np.concatenate([dequantize(np.ascontiguousarray(d), GGMLQuantizationType[t]) for t, d in segments]).astype(
            np.float32
        )
    )


class GGUFLinearMethod(QuantizedLinearMethod):
    """types: the file's quantized tensor types (for the blob width); shared: packed weights by
    the id of the Parameter they were loaded into (a tied LM head is the embedding's)."""

    def __init__(self, types, shared: dict) -> None:
        super().__init__()
        self.types, self.shared = tuple(types), shared

    def create_weights(self, layer, input_size, output_size):
        shape = (output_size, blob_width(self.types, input_size))
        layer.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        layer.weight.gguf_features = input_size  # on the Parameter: a tied head has no create_weights
        layer.weight.input_slice = lambda blob, features: torch.from_numpy(  # a row-parallel rank's features
            slice_row_blobs(blob.numpy(), features, shape[1])
        )

    def process_weights_after_loading(self, layer):
        param = layer.weight
        if id(param) not in self.shared:
            segments = _segments(param.detach().numpy(), param.gguf_features)
            if self.ops is None:
                self.shared[id(param)] = (_dequantized(segments), None)
            else:
                self.shared[id(param)] = pack_segments(segments, envs.PAGEDLLM_GGUF_ACTIVATIONS)
        packed, meta = self.shared[id(param)]
        layer.register_buffer("qweight", packed, persistent=False)
        layer.register_buffer("scales", meta, persistent=False)  # None without the extension
        layer.register_buffer("mins", torch.empty(0), persistent=False)
        layer.gguf_features = param.gguf_features
        layer.weight = None

    def apply(self, layer, x, bias=None):
        if layer.scales is None:
            return F.linear(x, layer.qweight, bias)
        return self.ops.gguf_linear(x, layer.qweight, layer.scales, bias)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> their rows [T, K] float32 (dequantised on lookup)."""
        if layer.scales is None:
            return F.embedding(ids, layer.qweight)
        shape = ids.shape
        return self.ops.gguf_dequantize_rows(
            layer.qweight, layer.scales, layer.gguf_features, ids.reshape(-1).long()
        ).view(*shape, -1)
