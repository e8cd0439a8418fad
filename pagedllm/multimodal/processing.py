"""The model's own HF processor turns a prompt and its images into token ids (each image's
placeholder tokens expanded) and pixel values; each image gets its placeholder range and content
hash (multimodal.inputs.ImageInput)."""
from __future__ import annotations

from typing import Any

from pagedllm.multimodal.hashing import hash_image
from pagedllm.multimodal.inputs import ImageInput


def load_mm_processor(model_dir: str):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_dir)


def images_of(multi_modal_data: Any) -> list:
    """{"image": a PIL image or a list of them} -> the images; ValueError naming what is wrong."""
    from PIL import Image
    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise ValueError(f"multi_modal_data must be a dict with the key 'image', got {multi_modal_data!r:.80}")
    images = multi_modal_data.get("image", [])
    images = images if isinstance(images, (list, tuple)) else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}")
    return [image.convert("RGB") for image in images]


def process_prompt(processor, prompt: str, images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A prompt with one image token per image -> (token ids, the images' inputs)."""
    image_token = processor.image_token
    if prompt.count(image_token) != len(images):
        raise ValueError(f"prompt has {prompt.count(image_token)} {image_token} placeholders for "
                         f"{len(images)} images: put one {image_token} where each image goes")
    if not images:
        return processor.tokenizer(prompt)["input_ids"], ()
    out = processor(text=[prompt], images=[images], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    pixels = out["pixel_values"][0]   # [tiles, 3, S, S]
    if pixels.shape[0] != len(images) or not out["pixel_attention_mask"].all():
        raise ValueError("images must be processed as one whole tile each (image processor "
                         "do_image_splitting=False); split images are not supported yet")
    runs = _runs(ids, processor.image_token_id)
    pixels = pixels.astype("float32")
    return ids, tuple(ImageInput(start, length, hash_image(image), pixels[i:i + 1])
                      for i, ((start, length), image) in enumerate(zip(runs, images)))


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
