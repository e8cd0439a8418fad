"""Idefics3 / SmolVLM checkpoints with random weights, made with transformers' own classes and
an Idefics3Processor over the SmolLM2 tokenizer (downloaded with `pagedllm download`; no hub):
no small vision-language model ships its weights where this machine can fetch them. Used by
`pagedllm bench vision`; the shapes are the real model's (the arithmetic is the same)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pagedllm.envs import pagedllm_home

# name -> (text config, vision config, scale_factor, image tokens, image side, splitting side)
SHAPES = {
    # As the tests' tiny checkpoint: 64 x 64 images, 16 tokens each.
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        ),
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        ),
        2,
        16,
        64,
    ),
    # HuggingFaceTB/SmolVLM-256M-Instruct: SigLIP-B/16 at 512 (1024 patches) shuffled by 4 into
    # 64 tokens per image tile, SmolLM2-135M's text model.
    "smolvlm-256m": (
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
        ),
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        ),
        4,
        64,
        512,
    ),
}


def make_random_vlm(out: str | os.PathLike, shape: str, seed: int = 0) -> Path:
    """A checkpoint of `shape` (one tile per image: no splitting) at `out`, written atomically."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagedllm.models.download import resolve_model

    text, vision, scale, tokens, side = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(str(resolve_model("SmolLM2-135M-Instruct")))
    ip = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side}
    )
    proc = Idefics3Processor(ip, tok, image_seq_len=tokens)
    cfg = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tok), rms_norm_eps=1e-5, tie_word_embeddings=False, **text),
        vision_config=vision,
        scale_factor=scale,
        image_token_id=proc.image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    proc.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def random_vlm_dir(shape: str) -> Path:
    """Its directory under $PAGEDLLM_HOME/models, made on first use."""
    if shape not in SHAPES:
        raise ValueError(f"random VLM shape {shape!r} is unknown; known: {', '.join(SHAPES)}")
    path = pagedllm_home() / "models" / f"random-vlm-{shape}"
    if not (path / "config.json").is_file():
        make_random_vlm(path, shape)
    return path
