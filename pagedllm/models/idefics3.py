"""Idefics3 / SmolVLM (Idefics3ForConditionalGeneration): a SigLIP encoder (models/siglip.py),
a pixel-shuffle connector into the text model's width, and a Llama text model over the paged KV
cache (models/llama.py, unchanged). The runner embeds the step's tokens, writes the cached image
features over the image placeholder rows (worker/encoder_cache.py) and hands the result to the
text model as its input hidden states."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.siglip import SiglipVisionTransformer
from pagedllm.models.vlm import VisionLanguageModel


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side*side, D] -> [B, side*side/scale^2, D*scale^2]: each scale x scale group of patches
    becomes one token (transformers' Idefics3Connector.pixel_shuffle, the same memory order)."""
    B, seq, D = x.shape
    side = int(seq**0.5)
    x = x.view(B, side, side // scale, D * scale).permute(0, 2, 1, 3)
    x = x.reshape(B, side // scale, side // scale, D * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(B, seq // (scale * scale), D * scale * scale)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        """hf: the text model's config with the whole config under "multimodal_config"
        (models/hf_config.py flatten_multimodal_config)."""
        super().__init__()
        if parallel is not None and parallel.world_size > 1:
            raise ValueError("Idefics3 runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1")
        mm = hf["multimodal_config"]
        vc = mm["vision_config"]
        self.scale = mm.get("scale_factor", 2)
        self.image_token_id = mm["image_token_id"]
        self.vision_model = SiglipVisionTransformer(vc)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = nn.Linear(
            vc["hidden_size"] * self.scale**2, hf["hidden_size"], bias=False
        )
        self.language_model = LlamaForCausalLM(hf, max_positions, None)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> image features [B, tokens per image, text hidden]."""
        x = self.vision_model(pixel_values.to(self.connector.modality_projection.proj.weight.dtype))
        return self.connector.modality_projection.proj(pixel_shuffle(x, self.scale))

    def text_weight_name(self, name: str):
        name = name.removeprefix("model.")
        return name.removeprefix("text_model.") if name.startswith("text_model.") or name == "lm_head.weight" else None
