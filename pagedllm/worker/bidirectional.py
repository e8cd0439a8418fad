"""The token spans of a step that attend to each other both ways: the images of a model whose
image tokens see each other at prefill (Gemma 3: `bidirectional_images`), for the attention
metadata (torch_sdpa/metadata.py build_attention_metadata's `bidirectional`). The scheduler
keeps each image's tokens in one step (SchedulerConfig.disable_chunked_mm_input): a span cut by
the step's end would let its first tokens miss the later ones, so it is an error here."""

from __future__ import annotations

from typing import Optional


def bidirectional_spans(states, num_computed, num_scheduled) -> Optional[dict]:
    """states: the batch's request states (their mm_inputs), num_computed / num_scheduled: each
    row's tokens before and in this step -> {row: [(lo, hi), ...]} in sequence positions, one
    span an image (a tile's run, for a split image) this step prefills; None when there is none.
    A loop over the requests with images and their images."""
    spans = {}
    for r, state in enumerate(states):
        c, end = int(num_computed[r]), int(num_computed[r]) + int(num_scheduled[r])
        if not state.mm_inputs or c >= state.mm_inputs[-1].end:  # no image, or past them (decoding)
            continue
        row = []
        for image in state.mm_inputs:
            for start, length in image.runs or ((0, image.length),):
                lo, hi = image.offset + start, image.offset + start + length
                if lo < end and hi > c:
                    if hi > end:
                        raise RuntimeError(
                            f"request {state.req_id}: image tokens [{lo}, {hi}) are split at {end} "
                            "by the step; the scheduler must keep them in one step"
                        )
                    row.append((lo, hi))
        if row:
            spans[r] = row
    return spans or None
