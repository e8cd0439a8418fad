"""Content hashes of images: the same pixels give the same key in every process and run."""

from __future__ import annotations

import hashlib


def hash_image(image) -> int:
    """A PIL image -> a 63-bit int from blake2b over its mode, size and pixel bytes (an int, so
    that a prefix-cache block key stays a tuple of ints)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}".encode())
    h.update(image.tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
