"""A GGUF file's key-value metadata as plain Python values (strings, numbers, lists)."""

from __future__ import annotations

from typing import Any


def read_metadata(reader) -> dict[str, Any]:
    """reader (gguf.GGUFReader) -> {key: value}; arrays as lists (the vocabulary included)."""
    return {name: field.contents() for name, field in reader.fields.items()}


class ArchMetadata:
    """The `{arch}.*` keys of one file, read with defaults and named in errors."""

    def __init__(self, meta: dict[str, Any], arch: str, where: str) -> None:
        self.meta, self.arch, self.where = meta, arch, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.where}: metadata {self.arch}.{key} is missing")
        return value
