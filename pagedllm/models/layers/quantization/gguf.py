"""A GGUF file served as it is: `--model FILE.gguf` (or `--quantization gguf` for the default
model's shipped Q4_1 file).

The config and tokenizer (with the chat template) come from the file's metadata through the
gguf package (models/gguf/: every registered architecture), saved once into a small directory
under $PAGEDLLM_HOME/gguf (`gguf_model_dir`), which names the file in gguf.json; the rest of
the engine reads that directory as any model directory. The weights are read from the file itself (`iter_weights`): each
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensor (the linears, the token
embedding, an untied head) as row blobs of the file's bytes, repacked after loading into
csrc/gguf_linear.cpp's layout (gguf_method.py, gguf_repack.py) and held so: a row dequantises to
the gguf package's values exactly, and the resident weights are the file's bytes (Q4_K / Q5_K:
4 more a block of 256). A tied LM head is the
embedding's packed weight; an embedding of another type is dequantised to float32 (its tied
head then re-quantized to int8 in groups of 32).
Tensor names, and what llama.cpp's converter did to a tensor, are models/gguf/tensor_names.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pagedllm.models.gguf.weights import gguf_weights, is_quantized_linear
from pagedllm.models.layers.quantization.gguf_dir import GGUF_MARKER as MARKER
from pagedllm.models.layers.quantization.gguf_dir import is_gguf_dir
from pagedllm.models.layers.quantization.gguf_method import GGUFLinearMethod, row_blob
from pagedllm.models.layers.quantization.gguf_repack import TYPE_IDS
from pagedllm.models.layers.quantization.int8 import LM_HEAD_GROUP, Int8LinearMethod


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

    write_model_dir(gguf_path, out, MARKER, tuple(TYPE_IDS))


class GGUFConfig:
    name = "gguf"

    def __init__(self, path: str, types: dict) -> None:
        self.path, self.types = path, types  # tensor name -> GGML type name
        linear = {t for n, t in types.items() if is_quantized_linear(n)}
        bad = linear - set(TYPE_IDS)
        if bad:
            raise ValueError(
                f"GGUF file {path}: linear weights of type {', '.join(sorted(bad))} are not "
                f"served as they are (supported: {', '.join(TYPE_IDS)})"
            )
        # The embedding and an untied head are held in their blocks where a kernel has their type
        # (else dequantised to float32, the head then int8 in groups of 32).
        self.quantized = {
            n
            for n, t in types.items()
            if t in TYPE_IDS and (is_quantized_linear(n) or n in ("token_embd.weight", "output.weight"))
        }
        self.held = {types[n] for n in self.quantized}
        self.shared: dict = {}  # packed weights by Parameter: a tied head is the embedding

    @classmethod
    def from_quant_args(cls, group_size, model_dir: str, hf_config) -> "GGUFConfig":  # registry.py
        return cls.from_model_dir(model_dir)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "GGUFConfig":
        info = gguf_info(model_dir)
        return cls(info["gguf_file"], info["tensor_types"])

    def _method(self):
        return GGUFLinearMethod(self.held, self.shared)

    def get_embedding_method(self):
        return self._method() if "token_embd.weight" in self.quantized else None

    def get_linear_method(self, lm_head: bool = False):
        if lm_head:
            tied = "output.weight" not in self.types
            if "output.weight" in self.quantized or (tied and "token_embd.weight" in self.quantized):
                return self._method()
            return Int8LinearMethod(LM_HEAD_GROUP, offset=False)
        return self._method()

    def iter_weights(self, model_dir: str):
        """(HF name, tensor): norms as float32, each quantized tensor (the linears, and the
        embedding / an untied head of a type with a kernel) as its row blob (gguf_method.row_blob),
        Q and K rows in HF's order; others dequantised to float32 (models/gguf/weights.py)."""
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        return gguf_weights(
            self.path, hf, lambda data, type_name: row_blob(data, type_name, self.held), also_blocks=self.quantized
        )
