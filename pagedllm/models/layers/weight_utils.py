"""Copying a checkpoint tensor (or this rank's slice of it) into a parameter."""

from __future__ import annotations

import torch


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, converting the dtype; a checkpoint tensor of another shape is refused (copy_
    would broadcast some)."""
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit the parameter's {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """For parameters held whole on every rank (norms)."""
    copy_weight(param.data, loaded)
