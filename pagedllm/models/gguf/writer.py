"""GGUF files from a transformers model (random weights of a real shape), written as llama.cpp's
convert_hf_to_gguf.py writes them: its tensor names (the gguf package's own name table), its
`{arch}.*` metadata, Q/K rows permuted for Llama / Mistral, Gemma's norms stored as 1 + w,
Llama 3's RoPE scaling as rope_freqs.weight, transformers' fused experts [E, 2I, H] written
as ffn_gate_exps / ffn_up_exps [E, I, H] (the router in F32), and a byte-level BPE vocabulary ("gpt2", as
llama.cpp writes for Llama 3 and Qwen 2) with ChatML special tokens. Each tensor's type is
file_types.py's rule; the gguf package quantizes (gguf.quants.quantize), kquants.py the K types
it cannot.

`pagedllm make-gguf --shape llama-3.2-1b --type Q4_0 --out FILE` (models/gguf/cli.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pagedllm.models.gguf.file_types import LLAMA_FTYPE, check_file_type, tensor_type
from pagedllm.models.gguf.kquants import K_QUANTIZERS

# HF model_type -> llama.cpp architecture name (Mistral is written as "llama").
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
}
PERMUTES_QK = ("llama", "mistral", "mixtral")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BPE_MERGES = 1000  # learned on BPE_TEXT: a real BPE whose ids stay far below any model's vocab
BPE_TEXT = (
    "A paged KV cache holds each sequence's keys and values in fixed-size blocks; the scheduler "
    "admits requests while blocks are free, and a finished request returns its blocks at once. "
    "Quantized weights are read block by block: a scale, sometimes a minimum, and small integers. "
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n"
    "The quick brown fox jumps over the lazy dog 0123456789 times, and then it rests."
)


def write_gguf(model, out, file_type: str, name: str = "random") -> Path:
    """Write the transformers causal LM `model` to the GGUF file `out` (file_type: file_types.py's
    FILE_TYPES, e.g. Q4_0 or the mix Q4_K_M)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    check_file_type(file_type)
    cfg = model.config
    if cfg.model_type not in GGUF_ARCH:
        raise ValueError(f"model_type {cfg.model_type!r} has no GGUF writer; supported: {', '.join(GGUF_ARCH)}")
    arch = GGUF_ARCH[cfg.model_type]
    out = Path(out)
    writer = GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_file_type(LLAMA_FTYPE[file_type])
    writer.add_quantization_version(2)
    _write_hparams(writer, cfg)
    _write_vocab(writer, cfg.vocab_size)
    has_output = not getattr(cfg, "tie_word_embeddings", False)
    for gguf_name, data in _gguf_tensors(model, arch):
        type_name = tensor_type(file_type, gguf_name, data.shape, cfg.num_hidden_layers, has_output)
        if type_name in ("F32", "F16"):
            writer.add_tensor(gguf_name, data.astype(np.float32 if type_name == "F32" else np.float16))
        else:
            t = GGMLQuantizationType[type_name]
            writer.add_tensor(gguf_name, quantize_rows(data, type_name), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantize_rows(data: np.ndarray, type_name: str) -> np.ndarray:
    """[..., K] float -> the type's blocks [..., row bytes]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in K_QUANTIZERS:
        rows = K_QUANTIZERS[type_name](data.reshape(-1, data.shape[-1]))
        return rows.reshape(*data.shape[:-1], rows.shape[-1])
    return quantize(data.astype(np.float32), GGMLQuantizationType[type_name])


def rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)  # Gemma 3: per layer type
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10_000.0)))


def _write_hparams(w, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type in PERMUTES_QK:
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if cfg.model_type == "gemma3_text":
        w.add_sliding_window(cfg.sliding_window)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _write_vocab(w, vocab_size: int) -> None:
    """A byte-level BPE learned on a fixed text, ChatML's special tokens,
    then unused tokens up to the model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = " ".join([BPE_TEXT] * 4)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the byte-level BPE's {len(alphabet) + len(SPECIAL_TOKENS)} "
            "tokens (its 256 bytes and the special tokens)"
        )
    merges_wanted = min(BPE_MERGES, vocab_size - len(alphabet) - len(SPECIAL_TOKENS))
    bpe.train_from_iterator(
        [text],
        trainers.BpeTrainer(vocab_size=len(alphabet) + merges_wanted, initial_alphabet=alphabet, show_progress=False),
    )
    spec = json.loads(bpe.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    first_special = len(tokens)
    unused_count = vocab_size - first_special - len(SPECIAL_TOKENS)
    tokens += list(SPECIAL_TOKENS) + [f"<|unused_{i}|>" for i in range(unused_count)]
    normal, control, unused = 1, 3, 5  # llama.cpp's token types
    types = [normal] * first_special + [control] * len(SPECIAL_TOKENS)
    types += [unused] * (vocab_size - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(first_special)  # <|endoftext|>
    w.add_eos_token_id(first_special + 2)  # <|im_end|>
    w.add_pad_token_id(first_special)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def _gguf_tensors(model, arch: str):
    """(llama.cpp name, float32 array) of every weight, transformed as convert_hf_to_gguf does."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    cfg = model.config
    arch_enum = next(a for a in MODEL_ARCH if MODEL_ARCH_NAMES[a] == arch)
    names = get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    tied = getattr(cfg, "tie_word_embeddings", False)
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        if hf_name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = tensor.detach().float().numpy().reshape(tensor.shape[0], 2, -1, tensor.shape[2]).swapaxes(0, 1)
            stem = hf_name.removesuffix("gate_up_proj")
            yield names.get_name(stem + "gate_proj") + ".weight", gate
            yield names.get_name(stem + "up_proj") + ".weight", up
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"tensor {hf_name!r} has no llama.cpp name for architecture {arch}")
        if not gguf_name.endswith((".weight", ".bias")):  # transformers' fused experts: no suffix
            gguf_name += ".weight"
        data = tensor.detach().float().numpy()
        if cfg.model_type in PERMUTES_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = permute_qk(data, heads)
        if cfg.model_type == "gemma3_text" and hf_name.endswith("norm.weight"):
            data = data + 1
        yield gguf_name, data
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "llama3":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        yield "rope_freqs.weight", llama3_rope_factors(scaling, rope_theta(cfg), head_dim)


def permute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors: one divisor per frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
