"""The model's own HF processor turns a prompt and its images into token ids (each image's
placeholder tokens expanded) and pixel values; each image gets its placeholder range and content
hash (multimodal.inputs.ImageInput)."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.hashing import hash_image
from pagedllm.multimodal.inputs import ImageInput


def load_mm_processor(model_dir: str, architecture: str = ""):
    from pagedllm.multimodal.qwen2_vl_processing import QWEN2_VL_ARCHITECTURES, Qwen2VLProcessing

    if architecture in QWEN2_VL_ARCHITECTURES:
        return Qwen2VLProcessing(model_dir)
    from pagedllm.multimodal.gemma3_processing import GEMMA3_ARCHITECTURES, Gemma3Processing

    if architecture in GEMMA3_ARCHITECTURES:
        return Gemma3Processing(model_dir)
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
        raise ValueError(
            f"prompt has {prompt.count(image_token)} {image_token} placeholders for "
            f"{len(images)} images: put one {image_token} where each image goes"
        )
    if hasattr(processor, "process"):  # pagedllm's own (multimodal/qwen2_vl_processing.py, gemma3_processing.py)
        return processor.process(prompt, images)
    if not images:
        return processor.tokenizer(prompt)["input_ids"], ()
    out = processor(text=[prompt], images=[images], return_tensors="np", return_text_replacement_offsets=True)
    ids = out["input_ids"][0].tolist()
    pixels = out["pixel_values"][0].astype("float32")  # [tiles of all the images, 3, S, S]
    # Each image's placeholder text (its expansion) says how many image tokens are its own.
    counts = [r["replacement"].count(image_token) for r in out["text_replacement_offsets"][0]]
    per_image = _group_runs(_runs(ids, processor.image_token_id), counts)
    tiles = sum(len(runs) for runs in per_image)
    if len(per_image) != len(images) or pixels.shape[0] < tiles or not out["pixel_attention_mask"][0, :tiles].all():
        raise ValueError(
            f"the processor gave {len(per_image)} placeholder groups and {pixels.shape[0]} tiles "
            f"for {len(images)} images: this processor's output is not supported"
        )
    inputs, tile = [], 0
    for runs, image in zip(per_image, images):
        start, end = runs[0][0], runs[-1][0] + runs[-1][1]
        split = tuple((s - start, n) for s, n in runs) if len(runs) > 1 else None
        inputs.append(ImageInput(start, end - start, hash_image(image), pixels[tile : tile + len(runs)], split))
        tile += len(runs)
    return ids, tuple(inputs)


def _group_runs(runs: list[tuple[int, int]], counts: list[int]) -> list[list[tuple[int, int]]]:
    """The runs of image tokens of each image, given each image's number of image tokens: one
    run, or, for Idefics3's split images, one per tile (a row / column tag between them)."""
    groups, at = [], 0
    for count in counts:
        group = []
        while at < len(runs) and count > 0:
            group.append(runs[at])
            count -= runs[at][1]
            at += 1
        if count != 0 or not group:
            return []  # the runs do not add up: refused by the caller
        groups.append(group)
    return groups if at == len(runs) else []


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
