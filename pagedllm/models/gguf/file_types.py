"""Which GGML type each tensor of a written file gets, as llama-quantize chooses
(llama-quant.cpp's llama_tensor_get_type, its main rules): norms, biases and the MoE router stay
F32; a matrix takes the file's type, or llama.cpp's fallback where its rows are not whole
256-value super-blocks; the _M mixes give the LM head (the tied embedding where there is no
head) and some layers' attn_v / ffn_down (first and last eighth, every third between) Q6_K.
"""

from __future__ import annotations

import re

# File types: the matrices' type, or a mix.
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
FILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", *MIXES, "F16", "F32")
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not a multiple of 256
LLAMA_FTYPE = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K": 12,
    "Q5_K": 16,
    "Q6_K": 18,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
}  # general.file_type (llama_ftype)
BIG_LAYER = re.compile(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight")


def check_file_type(file_type: str) -> None:
    if file_type not in FILE_TYPES:
        raise ValueError(f"type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(file_type: str, gguf_name: str, shape: tuple, n_layers: int, has_output: bool) -> str:
    """The GGML type name of one tensor (shape: numpy order, rows first)."""
    if len(shape) < 2 or ".ffn_gate_inp." in gguf_name or file_type == "F32":
        return "F32"
    base = MIXES.get(file_type, file_type)
    if file_type in MIXES:
        head = gguf_name == "output.weight" or (not has_output and gguf_name == "token_embd.weight")
        big = BIG_LAYER.fullmatch(gguf_name)
        if head or (big and _more_bits(int(big.group(1)), n_layers)):
            base = "Q6_K"
    if base in K_FALLBACK and shape[-1] % 256:
        return K_FALLBACK[base]
    return base
