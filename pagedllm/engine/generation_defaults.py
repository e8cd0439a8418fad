"""Sampling defaults from a model's generation_config.json (vLLM's --generation-config).

"auto" reads the model's own file, a folder path reads that folder's file, "vllm" takes none.
The fields vLLM takes (temperature, top_p, top_k, min_p, repetition_penalty) become the defaults
of a request that does not set them: offline, when generate() is given no SamplingParams; in the
server, field by field. Resolved once, when the engine's configuration is made, so a bad file
fails at start-up, not in a request.
"""

from __future__ import annotations

import os

from pagedllm.json_config import read_json_object
from pagedllm.sampling_params import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CHOICES = "'auto', 'vllm' or a folder holding a generation_config.json"


def load_sampling_defaults(source: str, model_dir: str) -> dict:
    """-> {field: value} for the FIELDS the file sets (an empty dict for 'vllm' or no file)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config must be {CHOICES}, got {source!r}")
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if source == "auto":
            return {}  # the model ships none: no defaults
        raise ValueError(f"generation_config: {path} does not exist; give {CHOICES}")
    config = read_json_object(path, f"generation_config: {path}")
    defaults = {k: config[k] for k in FIELDS if config.get(k) is not None}
    try:
        SamplingParams(**defaults)  # the same checks as a request's own values
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return defaults
