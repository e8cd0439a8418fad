"""A copy of a ready model's folder (its files linked, not copied) with a generation_config.json of
the test's own: the --generation-config tests' model."""

from __future__ import annotations

import json
import os

from pagedllm.models.download import resolve_model


def with_generation_config(model: str, folder: str, fields: dict) -> str:
    src = str(resolve_model(model, None))
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(src):
        if name != "generation_config.json":
            os.symlink(os.path.join(src, name), os.path.join(folder, name))
    with open(os.path.join(src, "generation_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({**config, **fields}, f)
    return folder
