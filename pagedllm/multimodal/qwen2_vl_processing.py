"""Qwen2-VL's (and Qwen2.5-VL's) prompt processing (what transformers' Qwen2VLProcessor does, without its video
half, which needs torchvision): the checkpoint's image processor cuts each image into patches on
a (t, h, w) grid, and each image token of the prompt is repeated t*h*w/merge^2 times."""

from __future__ import annotations

import numpy as np

from pagedllm.multimodal.hashing import hash_image
from pagedllm.multimodal.inputs import ImageInput

QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class Qwen2VLProcessing:
    image_token = "<|image_pad|>"
    chat_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"  # as Qwen2-VL's chat template writes an image

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge = self.image_processor.merge_size

    def process(self, prompt: str, images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
        """-> (token ids, the images' inputs): each image's pixel_values are its patches
        [t, h, w, C*2*P*P] (the grid travels in the shape)."""
        ids = self.tokenizer(prompt)["input_ids"]
        if not images:
            return ids, ()
        out = self.image_processor(images=images, return_tensors="np")
        grids = out["image_grid_thw"].tolist()
        patches = np.split(out["pixel_values"].astype("float32"), np.cumsum([t * h * w for t, h, w in grids])[:-1])
        where = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        expanded, inputs, at = [], [], 0
        for i, pos in enumerate(where.tolist()):
            t, h, w = grids[i]
            n = t * h * w // self.merge**2
            expanded += ids[at:pos]
            inputs.append(ImageInput(len(expanded), n, hash_image(images[i]), patches[i].reshape(t, h, w, -1)))
            expanded += [self.image_token_id] * n
            at = pos + 1
        return expanded + ids[at:], tuple(inputs)
