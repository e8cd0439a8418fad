"""Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): a SigLIP encoder
(models/siglip.py), the multimodal projector (each image's patch grid average-pooled to
mm_tokens_per_image tokens, a Gemma RMSNorm, a projection into the text width) and the Gemma 3
text model (models/gemma3.py, unchanged). The runner writes an image's features over its soft
tokens (worker/encoder_cache.py).

One difference in the text model's attention: an image's soft tokens attend to each other both
ways (transformers' block mask: full layers OR(causal, same image), sliding layers AND(window,
OR(causal, same image))). The runner gives the attention metadata each prefilled image's token
span (worker/bidirectional.py), so the scheduler keeps an image's tokens in one step
(SchedulerConfig.disable_chunked_mm_input, as vLLM forces for such models)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.selector import get_current_attn_backend
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.layers.layernorm import GemmaRMSNorm
from pagedllm.models.siglip import SiglipVisionTransformer
from pagedllm.models.vlm import VisionLanguageModel


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vc: dict, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.patches_per_side = vc["image_size"] // vc["patch_size"]
        tokens_per_side = int(tokens_per_image**0.5)
        if tokens_per_side**2 != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides "
                f"the {self.patches_per_side} patches per side"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc["hidden_size"], text_hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc["hidden_size"], vc.get("layer_norm_eps", 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, tokens per image, text hidden]."""
        B, _, D = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(B, D, side, side)  # [B, D, side, side]
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [B, tokens, D]
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    bidirectional_images = True  # an image's tokens see each other at prefill (worker/bidirectional.py)

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        """hf: the text model's config with the whole config under "multimodal_config"
        (models/hf_config.py flatten_multimodal_config)."""
        super().__init__()
        if parallel is not None and parallel.world_size > 1:
            raise ValueError(
                "Gemma 3 with images runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1"
            )
        backend = get_current_attn_backend()
        if not getattr(backend, "supports_bidirectional_spans", False):
            raise ValueError(
                f"the {backend.name} attention backend cannot let an image's tokens attend to "
                "each other (Gemma 3's image attention): use --attention-backend torch"
            )
        mm = hf["multimodal_config"]
        vc = mm["vision_config"]
        self.image_token_id = mm.get("image_token_index", mm.get("image_token_id"))
        self.tokens_per_image = mm.get("mm_tokens_per_image", 256)
        self.vision_tower = SiglipVisionTransformer(vc)
        self.multi_modal_projector = Gemma3MultiModalProjector(vc, hf["hidden_size"], self.tokens_per_image)
        self.language_model = Gemma3ForCausalLM(hf, max_positions, None)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> image features [B, tokens per image, text hidden]."""
        x = self.vision_tower(pixel_values.to(self.multi_modal_projector.mm_input_projection_weight.dtype))
        return self.multi_modal_projector(x)

    def text_weight_name(self, name: str) -> Optional[str]:
        # transformers 5's layout (model.language_model.*, model.vision_tower.*, lm_head) or the
        # checkpoints' older one (language_model.model.*, vision_tower.vision_model.*).
        name = name.removeprefix("model.")
        if name.startswith("language_model."):
            return name.removeprefix("language_model.")
        return name if name == "lm_head.weight" else None

    def vision_weight_name(self, name: str) -> str:
        return name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
