"""M-RoPE positions of a step (Qwen2-VL): each token's (temporal, height, width) positions
[3, T]. A request with images carries its prompt's positions and rope delta from its first
step (CachedRequestState.mrope, made by the model's image_positions); a prompt token takes its
column, a later token its index + delta on all three axes; a text-only request's positions are
its indices, the same on every axis."""

from __future__ import annotations

import torch


def step_mrope_positions(positions: torch.Tensor, query_start_loc: list[int], states) -> torch.Tensor:
    """positions [T] (each token's index in its request), query_start_loc [num_reqs + 1],
    states: the batch's CachedRequestStates in row order -> [3, T] int64. A loop over the
    requests with images, each vectorised."""
    out = positions.unsqueeze(0).repeat(3, 1)  # [3, T]
    for r, state in enumerate(states):
        if state.mrope is None:
            continue
        table, delta = state.mrope  # [3, prompt], int
        lo, hi = query_start_loc[r], query_start_loc[r + 1]
        idx = positions[lo:hi]
        in_prompt = idx < table.shape[1]
        out[:, lo:hi] = torch.where(in_prompt, table[:, idx.clamp(max=table.shape[1] - 1)], idx + delta)
    return out
