"""The model directory of a GGUF file: config.json and the tokenizer made from its metadata,
and gguf.json (the file's path and tensor types), checked before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedllm.models.gguf.hf_config import check_architecture, hf_config_from_gguf
from pagedllm.models.gguf.metadata import read_metadata
from pagedllm.models.gguf.reader import open_gguf
from pagedllm.models.gguf.tokenizer import write_tokenizer
from pagedllm.models.gguf.weights import check_tensors


def write_model_dir(gguf_path: Path, out: Path, marker: str, quantized_types) -> dict:
    """Write config.json, the tokenizer and `marker` (gguf.json) into out; -> the config.
    ValueError (nothing written) for an architecture, tensor or type that is not served."""
    where = str(gguf_path)
    reader = open_gguf(where)
    meta = read_metadata(reader)
    check_architecture(meta.get("general.architecture"), where)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}
    rope_freqs = tensors.get("rope_freqs.weight")
    hf = hf_config_from_gguf(meta, shapes, where, None if rope_freqs is None else np.array(rope_freqs.data))
    check_tensors(reader.tensors, hf, where, quantized_types)
    write_tokenizer(meta, where, hf["max_position_embeddings"], out)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    (out / marker).write_text(json.dumps({"gguf_file": where, "tensor_types": types}) + "\n")
    return hf
