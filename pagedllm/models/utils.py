"""Helpers for a model split into pipeline stages."""

from __future__ import annotations

from torch import nn


class PPMissingLayer(nn.Identity):
    """A module held by another pipeline stage: parameter names keep their global layer
    index, and a missing final norm passes the hidden states through."""


def pp_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """'name.' of every module this stage does not hold (its checkpoint weights are skipped)."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
