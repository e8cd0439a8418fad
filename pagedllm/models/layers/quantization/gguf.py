"""A GGUF file served as it is: `--model FILE.gguf` (or `--quantization gguf` for the default
model's shipped Q4_1 file).

The config and tokenizer (with the chat template) come from the file's metadata through
transformers' GGUF reader, saved once into a small directory under $PAGEDLLM_HOME/gguf
(`gguf_model_dir`), which names the file in gguf.json; the rest of the engine reads that
directory as any model directory. The weights are read from the file itself (`iter_weights`): each
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensor (the linears, the token
embedding, an untied head) as row blobs of the file's bytes, repacked after loading into
csrc/gguf_linear.cpp's layout (gguf_method.py, gguf_repack.py) and held so: a row dequantises to
the gguf package's values exactly, and the resident weights are the file's bytes (Q4_K / Q5_K:
4 more a block of 256). A tied LM head is the
embedding's packed weight; an embedding of another type is dequantised to float32 (its tied
head then re-quantized to int8 in groups of 32).
Llama-architecture files (llama.cpp's Q/K row order undone as transformers does).
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

from pagedllm.models.layers.quantization.gguf_dir import GGUF_MARKER as MARKER
from pagedllm.models.layers.quantization.gguf_dir import is_gguf_dir
from pagedllm.models.layers.quantization.gguf_method import GGUFLinearMethod, row_blob
from pagedllm.models.layers.quantization.gguf_repack import TYPE_IDS
from pagedllm.models.layers.quantization.int8 import LM_HEAD_GROUP, Int8LinearMethod

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def gguf_info(model_dir) -> dict:
    """gguf.json: {"gguf_file": path, "tensor_types": {name: GGML type name}}."""
    with open(os.path.join(str(model_dir), MARKER)) as f:
        return json.load(f)


def hf_name(name: str) -> str:
    """A llama.cpp tensor name -> the HF checkpoint name; ValueError for one it does not know."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} is not one of a Llama model's")


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
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.models.gguf_metadata import gguf_chat_template
    reader = GGUFReader(str(gguf_path))
    arch = reader.fields.get("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else None
    if arch != "llama":
        raise ValueError(f"GGUF file {gguf_path}: architecture {arch!r} is not served as it is "
                         "(llama only); convert it to an HF directory")
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tok.chat_template:
        tok.chat_template = gguf_chat_template(gguf_path)
    # The GGUF reader leaves model_max_length unset (1e30); the real limit is the context.
    tok.model_max_length = config.max_position_embeddings
    config.eos_token_id = tok.eos_token_id
    config.architectures = ["LlamaForCausalLM"]
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)
    # The tensor types, read once here: GGUFReader parses every metadata field (the whole vocabulary).
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    (out / MARKER).write_text(json.dumps({"gguf_file": str(gguf_path), "tensor_types": types}) + "\n")


class GGUFConfig:
    name = "gguf"

    def __init__(self, path: str, types: dict) -> None:
        self.path, self.types = path, types   # tensor name -> GGML type name
        linear = {t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")}
        bad = linear - set(TYPE_IDS)
        if bad:
            raise ValueError(f"GGUF file {path}: linear weights of type {', '.join(sorted(bad))} are not "
                             f"served as they are (supported: {', '.join(TYPE_IDS)})")
        # The embedding and an untied head are held in their blocks where a kernel has their type
        # (else dequantised to float32, the head then int8 in groups of 32).
        self.quantized = {n for n, t in types.items() if t in TYPE_IDS}
        self.held = {types[n] for n in self.quantized}
        self.shared: dict = {}   # packed weights by Parameter: a tied head is the embedding

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
        """(HF name, tensor): norms as float32, each quantized tensor as its row blob
        (gguf_method.row_blob), Q and K rows in HF's order; others dequantised to float32."""
        from gguf import GGUFReader
        from gguf.quants import dequantize
        reader = GGUFReader(self.path)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        heads = {"attn_q": cfg["num_attention_heads"],
                 "attn_k": cfg.get("num_key_value_heads", cfg["num_attention_heads"])}
        for t in reader.tensors:
            name, type_name = hf_name(t.name), t.tensor_type.name
            if t.name not in self.quantized:
                yield name, torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
                continue
            blob = row_blob(np.asarray(t.data), type_name, self.held)
            kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
            if kind in heads:   # llama.cpp interleaves each head's rotary halves
                n = heads[kind]
                blob = blob.reshape(n, -1, 2, *blob.shape[1:]).swapaxes(1, 2).reshape(blob.shape)
            yield name, torch.from_numpy(np.ascontiguousarray(blob))
