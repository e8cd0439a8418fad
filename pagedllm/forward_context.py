"""The step's state that every layer reads during one model forward (vLLM's forward context,
nano-vllm's utils/context.py): set by the runner around the model call, so that the model's
forward takes only the tokens and positions."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional


@dataclass
class ForwardContext:
    attn_metadata: Any  # the attention backend's metadata of this step (one for every layer)


_forward_context: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Layers called inside this block read `attn_metadata` (nested blocks restore the outer)."""
    global _forward_context
    prev, _forward_context = _forward_context, ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "no forward context: run the model inside "
            "pagedllm.forward_context.set_forward_context(attn_metadata) "
            "(the model runner does this around each step)"
        )
    return _forward_context


def get_group_metadata(group_id: int) -> Any:
    """The step's metadata of one KV cache group (the runner's list holds one per group; with
    one group it is the metadata itself)."""
    meta = get_forward_context().attn_metadata
    return meta[group_id] if isinstance(meta, list) else meta
