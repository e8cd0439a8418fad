"""Tensor parallelism over a GGUF file held in its blocks: which bytes of each row a rank holds.

A GGUF row is whole blocks of its type (32 features for Q4_0 / Q8_0, 256 for the K types), so a
rank can hold any range of OUTPUT rows (the column-parallel QKV, gate/up, the vocabulary-split
embedding and head: the layers' loaders cut the row blobs by row, and each rank repacks its own
rows). A row-parallel linear (o_proj, down_proj) holds a range of INPUT features: a range of
each row's blocks, possible only where the range starts and ends on a block boundary of the
tensor's type. `check_tp_split` says so before anything is loaded (EngineConfig, compat.py);
`slice_row_blobs` cuts the bytes at load. Torch-free (the config check imports it).
"""

from __future__ import annotations

import json
import os

import numpy as np

from pagedllm.distributed.sharding import plan_tp_shard
from pagedllm.models.hf_config import head_dim_of

# The row-parallel matrices held in blocks (tensor_names.py: o_proj, down_proj) -> the input
# features a TP shard holds.
ROW_PARALLEL = {
    "attn_output": lambda tp, head_dim: range(tp.q_heads.start * head_dim, tp.q_heads.stop * head_dim),
    "ffn_down": lambda tp, head_dim: tp.intermediate,
}


def block_size(type_name: str) -> tuple[int, int]:
    """(features, bytes) of one block of a GGML type (F16 / F32: 1 feature)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def feature_bytes(type_name: str, features: range) -> range:
    """The bytes of a row of this type that hold `features`; ValueError where the range does not
    start and end on a block boundary."""
    feats, nbytes = block_size(type_name)
    if features.start % feats or features.stop % feats:
        raise ValueError(
            f"input features {features.start}..{features.stop - 1} of a {type_name} row are not whole blocks of {feats}"
        )
    return range(features.start // feats * nbytes, features.stop // feats * nbytes)


def slice_row_blobs(blob: np.ndarray, features: range, width: int) -> np.ndarray:
    """Row blobs [N, W] uint8 (gguf_method.row_blob: the GGML type number, the row's bytes,
    padding) of whole rows -> [N, width] holding only `features` of each row."""
    from gguf.constants import GGMLQuantizationType

    out = np.zeros((blob.shape[0], width), dtype=np.uint8)
    out[:, 0] = blob[:, 0]
    for type_id in np.unique(blob[:, 0]):
        rows = blob[:, 0] == type_id
        b = feature_bytes(GGMLQuantizationType(int(type_id)).name, features)
        out[rows, 1 : 1 + len(b)] = blob[rows, 1 + b.start : 1 + b.stop]
    return out


def check_tp_split(model_dir: str, hf: dict, tp_size: int) -> None:
    """ValueError naming the first row-parallel tensor of a GGUF model directory (gguf.json's
    tensor types) whose input features do not split over tp_size ranks at its blocks."""
    from pagedllm.models.layers.quantization.gguf_dir import GGUF_MARKER

    with open(os.path.join(model_dir, GGUF_MARKER)) as f:
        info = json.load(f)
    head_dim = head_dim_of(hf)
    num_heads = hf["num_attention_heads"]
    shards = [
        plan_tp_shard(
            num_heads, hf.get("num_key_value_heads", num_heads), hf["intermediate_size"], hf["vocab_size"], tp_size, r
        )
        for r in range(tp_size)
    ]
    for name, type_name in info["tensor_types"].items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in ROW_PARALLEL or parts[3] != "weight":
            continue
        feats = block_size(type_name)[0]
        for tp in shards:
            r = ROW_PARALLEL[parts[2]](tp, head_dim)
            if r.start % feats or r.stop % feats:
                total = ROW_PARALLEL[parts[2]](shards[-1], head_dim).stop
                raise ValueError(
                    f"tensor_parallel_size {tp_size}: GGUF tensor {name} ({type_name}, {total} input features "
                    f"in blocks of {feats}) would give rank {tp.tp_rank} input features {r.start}..{r.stop - 1} "
                    f"({len(r)}), not whole {type_name} blocks; a row-parallel split must fall on block "
                    f"boundaries (use a tensor_parallel_size whose shares are multiples of {feats}, or 1)"
                )
