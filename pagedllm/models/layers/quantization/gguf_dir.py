"""A GGUF model directory: the small directory (config, tokenizer) that serves a GGUF file as it
is, marked by GGUF_MARKER naming the file (gguf.py makes it)."""

import os

GGUF_MARKER = "gguf.json"


def is_gguf_dir(path) -> bool:
    return os.path.isfile(os.path.join(str(path), GGUF_MARKER))
