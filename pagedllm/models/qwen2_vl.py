"""Qwen2-VL (Qwen2VLForConditionalGeneration): the vision transformer of models/qwen2_vl_vision.py
and a Qwen2 text model (models/llama.py) whose rotary embedding is M-RoPE: each token has three
positions (temporal, height, width); the head's frequencies are cut into three sections
(`mrope_section`), each rotated by one of them. A text token has the same position three times
(plain RoPE); an image's tokens share one temporal position and take their row / column in the
merged grid, offset by the text before; the text after continues one past the image's largest
position, so a prompt's positions end below its length and decoding goes on at
len + `rope_delta`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.models.layers.rotary_embedding import RotaryEmbedding, _rotate
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTransformer
from pagedllm.models.vlm import VisionLanguageModel


def mrope_positions(num_tokens: int, images, merge: int) -> tuple[np.ndarray, int]:
    """The prompt's M-RoPE positions [3, num_tokens] and its rope delta (the decode position of
    token i is i + delta on all three axes). images: each image's (offset, (t, h, w)) in patches,
    in prompt order, its t*h*w/merge^2 placeholder tokens from offset. A loop over the images;
    each run of text or image vectorised."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    at, nxt = 0, 0  # next prompt index, next position
    for offset, (t, h, w) in images:
        pos[:, at:offset] = np.arange(nxt, nxt + offset - at)
        nxt += offset - at
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, offset : offset + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + nxt
        at, nxt = offset + n, nxt + max(gh, gw)
    pos[:, at:] = np.arange(nxt, nxt + num_tokens - at)
    nxt += num_tokens - at
    return pos, nxt - num_tokens


class MRotaryEmbedding(RotaryEmbedding):
    """positions [3, T] (or [T]: every axis the same, plain RoPE) -> q, k rotated, frequency j
    by the position of its section's axis."""

    def __init__(self, hf: dict, head_dim: int, max_positions: int) -> None:
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        sections = rope.get("mrope_section")
        # Qwen's checkpoints name the type "mrope" (rope_scaling); its frequencies are the default ones.
        rope.pop("type", None)
        rope["rope_type"] = "default" if rope.get("rope_type", "mrope") == "mrope" else rope["rope_type"]
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        super().__init__({**hf, "rope_parameters": rope, "rope_scaling": None}, head_dim, max_positions)
        if not sections or sum(sections) != self.rot_dim // 2:
            raise ValueError(
                f"rope_parameters.mrope_section {sections} must add up to head_dim/2 = {self.rot_dim // 2}"
            )
        axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
        self.register_buffer("axis", torch.cat((axis, axis)).to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        # [3, T, rot] tables at each axis' positions -> [T, rot], column j from axis[j].
        cos = self.cos[positions].gather(0, self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1))[0]
        sin = self.sin[positions].gather(0, self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1))[0]
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)  # [T, 1, rot]
        return _rotate(q, cos, sin, self.rot_dim), _rotate(k, cos, sin, self.rot_dim)


class Qwen2VLTextModel(LlamaForCausalLM):
    def make_rope(self, hf: dict, head_dim: int, max_positions: int) -> nn.Module:
        return MRotaryEmbedding(hf, head_dim, max_positions)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True  # the runner gives positions [3, T] (mrope_positions at prefill)
    vision_class = Qwen2VLVisionTransformer  # Qwen2.5-VL's: models/qwen2_5_vl.py

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        """hf: the text model's config with the whole config under "multimodal_config"
        (models/hf_config.py flatten_multimodal_config)."""
        super().__init__()
        if parallel is not None and parallel.world_size > 1:
            raise ValueError(
                f"{type(self).__name__} runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1"
            )
        mm = hf["multimodal_config"]
        self.image_token_id = mm["image_token_id"]
        self.merge = mm["vision_config"].get("spatial_merge_size", 2)
        self.visual = self.vision_class(mm["vision_config"])
        # Qwen2: biases on q, k and v only (models/llama.py reads model_type).
        self.language_model = Qwen2VLTextModel({**hf, "model_type": "qwen2"}, max_positions, None)

    def encode_image_list(self, pixel_values: list[np.ndarray]) -> list[torch.Tensor]:
        """Each image's patches [t, h, w, C*2*P*P] -> its features [t*h*w/merge^2, text hidden]."""
        grids = [tuple(p.shape[:3]) for p in pixel_values]
        device = self.visual.patch_embed.proj.weight.device
        patches = torch.cat([torch.from_numpy(p).reshape(-1, p.shape[-1]) for p in pixel_values]).to(device)
        feats = self.visual(patches, grids)
        return list(feats.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def image_positions(self, num_tokens: int, images) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, num_tokens] and rope delta; images: its ImageInputs."""
        return mrope_positions(num_tokens, [(im.offset, im.pixel_values.shape[:3]) for im in images], self.merge)

    def text_weight_name(self, name: str):
        # Qwen's layout (model.* text, visual.*) or transformers' (model.language_model.*, model.visual.*).
        name = name.removeprefix("model.")
        return None if name.startswith("visual.") else name.removeprefix("language_model.")
