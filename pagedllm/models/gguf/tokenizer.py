"""`tokenizer.ggml.*` metadata -> a saved fast tokenizer (tokenizer.json, tokenizer_config.json
with the chat template and the special tokens).

The vocabulary, merges, scores and token types are read here (gguf package); the tokenizers
object is built from them by transformers' builders for GGUF vocabularies (byte-level BPE for
`gpt2`, SentencePiece BPE for `llama`, with Gemma's respelling), on metadata only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# tokenizer.ggml.<key> -> the name transformers' builders read it under.
VOCAB_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
TOKENIZER_MODELS = ("gpt2", "llama")


def gguf_tokenizer(meta: dict[str, Any], where: str, model_max_length: int):
    """A transformers fast tokenizer (TokenizersBackend) of the file's vocabulary."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            f"GGUF file {where}: tokenizer.ggml.model {kind!r} is not supported "
            f"(supported: {', '.join(TOKENIZER_MODELS)}, with tokenizer.ggml.tokens)"
        )
    vocab = {name: meta[f"tokenizer.ggml.{key}"] for key, name in VOCAB_KEYS.items() if f"tokenizer.ggml.{key}" in meta}
    tokens = vocab["tokens"]
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    config = {
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
        "chat_template": meta.get("tokenizer.chat_template") or None,
        "model_max_length": model_max_length,
    }
    for name, key in SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], vocab)
    return TokenizersBackend(tokenizer_object=backend, **config)


def write_tokenizer(meta: dict[str, Any], where: str, model_max_length: int, out: Path):
    tok = gguf_tokenizer(meta, where, model_max_length)
    tok.save_pretrained(out)
    return tok
