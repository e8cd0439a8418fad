"""The scheduler's side of images (vLLM v1's encoder budget; torch-free): how many prompt tokens a
step may schedule so that the images it starts fit the encoder budget, and which images a
block of tokens covers (their hashes key the block in the prefix cache)."""

from __future__ import annotations

from typing import Sequence


def trim_to_encoder_budget(images: Sequence, start: int, n: int, budget: int, whole: bool = False) -> tuple[int, int]:
    """images (multimodal.inputs.ImageInput: offset, length), tokens [start, start + n) to
    schedule, encoder budget left (in image tokens) -> (tokens to schedule, budget used). An image
    that starts in the window is encoded this step; the window stops before the first image that
    does not fit, unless it is the first thing to compute (it runs alone, so no image waits forever).
    whole (SchedulerConfig.disable_chunked_mm_input, vLLM's rule): the window never ends inside
    an image; it stops before it (0 tokens when it starts inside or at it: the request waits)."""
    used = 0
    for image in images:
        if whole and image.offset < start + n < image.end:
            return max(image.offset - start, 0), used
        if start <= image.offset < start + n:
            if used + image.length > budget and image.offset > start:
                return image.offset - start, used
            used += image.length
    return n, used


def block_image_keys(images: Sequence, num_blocks: int, block_size: int) -> list[tuple]:
    """The content hashes of the images each of the first num_blocks blocks covers, one tuple
    per block: a block's KV depends on the image features at its own tokens and, through
    attention, on every earlier one (the parent hash chains those)."""
    keys: list[tuple] = [() for _ in range(num_blocks)]
    for image in images:
        first, last = image.offset // block_size, (image.end - 1) // block_size
        for b in range(first, min(last + 1, num_blocks)):
            keys[b] = keys[b] + (image.hash,)
    return keys
