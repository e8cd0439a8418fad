"""Gemma 3's prompt processing through transformers' own Gemma3Processor: the prompt marks each
image with its begin-of-image token (`<start_of_image>`), which the processor expands to
"\n\n<start_of_image>" + mm_tokens_per_image soft tokens + "<end_of_image>\n\n"; the soft tokens
take the image's features (one SigLIP tile each, 896 x 896 in Google's checkpoints). Pan-and-scan crops are refused."""

from __future__ import annotations

import numpy as np

from pagedllm.multimodal.hashing import hash_image
from pagedllm.multimodal.inputs import ImageInput

GEMMA3_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


class Gemma3Processing:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        if getattr(self.processor.image_processor, "do_pan_and_scan", False):
            raise ValueError(
                "the image processor's do_pan_and_scan is not supported: set it to false in preprocessor_config.json"
            )
        self.tokenizer = self.processor.tokenizer
        self.image_token = self.processor.boi_token  # what a prompt writes per image
        self.soft_token_id = self.tokenizer.image_token_id  # what the features replace
        self.tokens_per_image = self.processor.image_seq_length

    def process(self, prompt: str, images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
        """-> (token ids, the images' inputs): each image's pixel_values [1, 3, S, S]."""
        if not images:
            return self.tokenizer(prompt)["input_ids"], ()
        out = self.processor(text=[prompt], images=[images], return_tensors="np")
        ids = out["input_ids"][0]
        pixels = out["pixel_values"].astype("float32")  # [images, 3, S, S]
        n = self.tokens_per_image
        # Each image's soft tokens are one run of n: its first token starts a run.
        soft = ids == self.soft_token_id
        starts = np.flatnonzero(soft & ~np.r_[False, soft[:-1]])
        if len(starts) != len(images) or pixels.shape[0] != len(images) or soft.sum() != n * len(images):
            raise ValueError(
                f"the processor gave {len(starts)} image token runs and {pixels.shape[0]} "
                f"pixel tiles for {len(images)} images: this processor's output is not supported"
            )
        inputs = tuple(
            ImageInput(int(s), n, hash_image(image), pixels[i : i + 1])
            for i, (s, image) in enumerate(zip(starts, images))
        )
        return ids.tolist(), inputs
