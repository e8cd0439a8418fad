"""Model directories with random weights, in the shape of a real model, made on this machine.

`--model random:<shape>` (e.g. `random:llama-3.2-1b`) resolves to
`$PAGEDLLM_HOME/models/random-<shape>`, made on first use: the shape's transformers model class
(Llama unless the shape says `model_type`) with random weights (seed 0) saved as safetensors,
and a word-level tokenizer that names every id
("w123"), so that any id a random model samples decodes. Benchmarks and GPU tests use them
where the default model does not cover a shape; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

from pagedllm.envs import pagedllm_home

# Shapes as in the models' config.json (the weights are random, the arithmetic is the same).
SHAPES = {
    # Small enough for Triton's interpreter in the CPU tests; GQA 2, head_dim 32.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
    ),
    # Every matrix whole 256-value super-blocks (K-type GGUF files keep their type), and at TP=2
    # an uneven split (3 KV heads: 4 and 8 query heads of 64) whose o_proj / down_proj shares
    # are still whole super-blocks; a vocabulary that is no multiple of 16.
    "tiny-superblocks": dict(
        hidden_size=768,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
    ),
    # meta-llama/Llama-3.2-1B: 1.24 B parameters, GQA 4, head_dim 64, llama3 RoPE scaling.
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    # Qwen/Qwen2.5-1.5B: 1.54 B parameters, GQA 6, head_dim 128, q/k/v biases.
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
}
PREFIX = "random:"
UNK, BOS, EOS = 0, 1, 2


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over "w<id>" words: text "w5 w17" <-> ids [5, 17]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab.update({"<unk>": UNK, "<s>": BOS, "</s>": EOS})
    del vocab[f"w{UNK}"], vocab[f"w{BOS}"], vocab[f"w{EOS}"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
                "model_max_length": 1 << 30,
                "add_bos_token": False,
            },
            indent=1,
        )
    )


def random_hf_model(shape: str, seed: int = 0, initializer_range: float = 0.02):
    """The transformers model of `shape` (its own class) with random weights, in the shape's dtype."""
    if shape not in SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; known: {', '.join(SHAPES)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = copy.deepcopy(SHAPES[shape])
    dtype = getattr(torch, spec.pop("torch_dtype"))
    cfg = AutoConfig.for_model(
        spec.pop("model_type", "llama"),
        **spec,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=UNK,
        initializer_range=initializer_range,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def make_random_model(out: str | os.PathLike, shape: str, seed: int = 0, initializer_range: float = 0.02) -> Path:
    """Write config.json, model.safetensors and a tokenizer for `shape` into `out`."""
    model = random_hf_model(shape, seed, initializer_range)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    _write_tokenizer(tmp, model.config.vocab_size)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def random_model_dir(name: str) -> Path:
    """'random:<shape>' -> its directory under $PAGEDLLM_HOME/models, made on first use."""
    shape = name[len(PREFIX) :]
    if shape not in SHAPES:
        raise ValueError(
            f"model {name!r}: unknown random shape {shape!r}; known: " + ", ".join(PREFIX + s for s in SHAPES)
        )
    path = pagedllm_home() / "models" / f"random-{shape}"
    if not (path / "config.json").is_file():
        make_random_model(path, shape)
    return path
