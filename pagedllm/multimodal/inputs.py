"""One image of a request as the engine carries it (vLLM v1's MultiModalFeatureSpec, reduced)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageInput:
    """offset, length: the placeholder tokens [offset, offset + length) of the prompt that the
    image's encoder output replaces, one feature row per token. hash: the image's content hash
    (the encoder cache's key, and a prefix-cache block key). pixel_values: the processor's
    float32 array [tiles, 3, S, S] (numpy: it crosses to the core process as bytes), read by the
    runner only."""
    offset: int
    length: int
    hash: int
    pixel_values: Any

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt whose images the HF processor has expanded (Processor.process_images): the text,
    its token ids and its images. The server makes one before its context-length check and
    hands it to the engine as the prompt, so that the images are processed once."""
    text: str
    token_ids: list
    mm_inputs: tuple
