"""One image of a request as the engine carries it (vLLM v1's MultiModalFeatureSpec, reduced)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """offset, length: the placeholder tokens [offset, offset + length) of the prompt that the
    image's encoder output replaces, one feature row per token. hash: the image's content hash
    (the encoder cache's key, and a prefix-cache block key). pixel_values: the processor's
    float32 array [tiles, 3, S, S] (numpy: it crosses to the core process as bytes), read by the
    runner only; its features are [tiles * tokens per tile, hidden]."""

    offset: int
    length: int
    hash: int
    pixel_values: Any
    # A split image (Idefics3's tiles): the runs (start from offset, length) of its placeholder
    # tokens inside [offset, end), text tokens (a tile's row / column tag) between them; the
    # features fill the runs in order. None: the whole range is one run.
    runs: Optional[tuple] = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def feature_rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Prompt positions in [lo, hi) that take a feature row, and the index of each one's row
        among the image's features (a loop over the tiles, not the tokens)."""
        pos, idx, done = [], [], 0
        for start, n in self.runs or ((0, self.length),):
            a, b = max(lo, self.offset + start), min(hi, self.offset + start + n)
            if a < b:
                pos.append(np.arange(a, b))
                idx.append(np.arange(a, b) - (self.offset + start) + done)
            done += n
        if not pos:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(pos), np.concatenate(idx)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt whose images the HF processor has expanded (Processor.process_images): the text,
    its token ids and its images. The server makes one before its context-length check and
    hands it to the engine as the prompt, so that the images are processed once."""

    text: str
    token_ids: list
    mm_inputs: tuple
