"""A tiny random-weight Llama with the default model's tokenizer and ChatML template: a random
model samples almost uniformly, so a grammar alone must make its output valid (JSON, regex,
choice, tool calls), and it runs in milliseconds a step."""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_chat_model(out: Path, default_model_dir: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.random_model import SHAPES
    if (out / "config.json").is_file():
        return out
    spec = dict(SHAPES["tiny"])
    spec.pop("torch_dtype")
    spec.update(vocab_size=49152, max_position_embeddings=2048)
    src = Path(default_model_dir)
    cfg = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype=torch.float32)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out
