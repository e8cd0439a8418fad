"""--limit-mm-per-prompt (vLLM's flag and JSON form, '{"image": N}'): the most items of each
modality one prompt may carry; a prompt over it is refused before its images are loaded. And
--allowed-local-media-path, checked at start."""

from __future__ import annotations

import os

from pagedllm.config import DEFAULT_MM_LIMIT, MM_MODALITIES
from pagedllm.json_config import json_object
from pagedllm.sampling_params import ParamError


def parse_limit_mm_per_prompt(value) -> dict[str, int]:
    """JSON text or a dict -> {modality: limit}; ValueError naming the flag and what is allowed."""
    name = "limit_mm_per_prompt"
    if value is None:
        return {}
    value = json_object(value, name)
    for k, v in value.items():
        if k not in MM_MODALITIES:
            raise ValueError(f"{name}: unknown modality {k!r}; allowed: {', '.join(MM_MODALITIES)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: {k!r} must be an integer >= 0, got {v!r}")
    return dict(value)


def check_item_count(limits: dict[str, int], modality: str, count: int, param: str) -> None:
    """ParamError(param) when a prompt has more `modality` items than the limit allows."""
    limit = limits.get(modality, DEFAULT_MM_LIMIT)
    if count > limit:
        raise ParamError(
            param,
            f"{param}: at most {limit} {modality}(s) may be provided in one prompt, got "
            f"{count} (--limit-mm-per-prompt '{{\"{modality}\": N}}' sets the limit)",
        )


def check_allowed_local_media_path(path) -> str:
    """ "" (no file:// URLs) or an existing directory; ValueError otherwise."""
    if not path:
        return ""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"allowed_local_media_path must be an existing directory, got {path!r}")
    return path
