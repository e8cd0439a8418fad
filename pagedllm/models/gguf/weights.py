"""A GGUF file's tensors as (HF name, tensor) for the model's load_weights, and the check,
before anything is loaded, that every tensor has a name and a type the engine serves."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from pagedllm.models.gguf.tensor_names import QUANTIZED_LINEARS, TensorMap

FLOAT_TYPES = ("F32", "F16", "BF16")
# repack(raw blocks [rows, row bytes], GGML type name) -> the quantized linear's row blob [rows, ...]
Repack = Callable[[np.ndarray, str], np.ndarray]


def is_quantized_linear(gguf_name: str) -> bool:
    """A dense layer's matrix (blk.N.attn_q.weight ...), held by the engine in the file's blocks."""
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in QUANTIZED_LINEARS and parts[3] == "weight"


def dequantizable_types() -> set[str]:
    """The GGML types the gguf package dequantises (for norms, embeddings, experts, biases)."""
    from gguf.quants import _type_traits

    return set(FLOAT_TYPES) | {t.name for t in _type_traits}


def check_tensors(tensors, hf: dict, where: str, quantized_types) -> None:
    """ValueError naming the first tensor whose name has no place in the model or whose type the
    engine does not serve (tensors: GGUFReader.tensors; quantized_types: what a quantized linear
    takes as it is)."""
    tmap, dequantizable = TensorMap(hf), dequantizable_types()
    for t in tensors:
        target = tmap.target(t.name)
        type_name = t.tensor_type.name
        if target is None:
            continue
        if target.quantized and type_name not in quantized_types:
            raise ValueError(
                f"GGUF file {where}: tensor {t.name} has type {type_name}, which a linear layer "
                f"does not serve as it is (supported: {', '.join(quantized_types)})"
            )
        if not target.quantized and type_name not in dequantizable:
            raise ValueError(
                f"GGUF file {where}: tensor {t.name} has type {type_name}, which cannot be "
                f"dequantised (supported: {', '.join(sorted(dequantizable))})"
            )


def unpermute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's LlamaModel.permute: per head, rows (2, D/2) -> (D/2, 2) there."""
    return rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_weights(path: str, hf: dict, repack: Repack, also_blocks=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file at `path` under its HF name: quantized linears (and the tensors
    named in also_blocks: an embedding, an untied head) as repack makes them, everything else
    dequantised to float32; stacked experts one expert at a time."""
    from gguf.quants import dequantize

    from pagedllm.models.gguf.reader import open_gguf

    tmap = TensorMap(hf)
    for t in open_gguf(path).tensors:
        target = tmap.target(t.name)
        if target is None:
            continue
        if target.quantized or t.name in also_blocks:
            arr = repack(np.asarray(t.data), t.tensor_type.name)
        else:
            arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if target.norm_shift:
                arr -= np.float32(target.norm_shift)
        if target.heads:
            arr = unpermute_qk(arr, target.heads)
        if target.experts:  # [E, N, K]
            for e in range(arr.shape[0]):
                yield target.name.format(e=e), torch.from_numpy(np.ascontiguousarray(arr[e]))
        else:
            yield target.name, torch.from_numpy(np.ascontiguousarray(arr))
