"""What a GGUF file's metadata says beyond its tensors (read by the ready-model builder in
download.py and by the GGUF-as-is loader in layers/quantization/gguf.py)."""

from __future__ import annotations

from pathlib import Path


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in a GGUF file's metadata."""
    from pagedllm.models.gguf.reader import open_gguf

    field = open_gguf(gguf_path).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
