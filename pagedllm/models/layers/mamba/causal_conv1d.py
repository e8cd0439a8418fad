"""Causal depthwise conv1d with a carried state (LFM2's short convolution, Mamba2's conv):
y[t] = sum_k w[k] * x[t - (K-1) + k] per channel, the K-1 inputs before a chunk taken from
the state left by the previous chunk (zeros at a request's start), so chunked prefill and
token-by-token decode give the same outputs as one pass over the whole sequence.

Several requests at once: their tokens are packed along one axis (query_start_loc), each with
its own state row; one unfold over the padded [state | chunk] of every request, no loop over
tokens. A step of one token a request (every request scheduled has at least one) appends it to
its state row instead: no padding, index or gather.
"""

from __future__ import annotations

import torch


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor, query_start_loc: torch.Tensor
) -> torch.Tensor:
    """x [num_tokens, channels] (requests packed, request i at query_start_loc[i]:[i+1]);
    weight [channels, K]; bias [channels] or None; state [num_reqs, channels, K-1], the inputs
    before each request's chunk, updated in place to its last K-1 inputs -> y [num_tokens, channels]."""
    num_tokens, channels = x.shape
    k = weight.shape[1]
    if weight.shape[0] != channels or state.shape[1:] != (channels, k - 1):
        raise ValueError(
            f"weight must be [{channels}, K] and state [num_reqs, {channels}, K-1], "
            f"got {tuple(weight.shape)} and {tuple(state.shape)}"
        )
    if num_tokens == state.shape[0]:  # one token a request (a step of decodes): no padding
        window = torch.cat([state.to(x.dtype), x.unsqueeze(2)], dim=2)  # [num_reqs, channels, K]
        y = (window * weight).sum(-1)
        state.copy_(window[:, :, 1:].to(state.dtype))
        return y + bias if bias is not None else y
    starts = query_start_loc[:-1]
    lens = query_start_loc[1:] - starts  # [num_reqs]
    num_reqs, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    # padded[r, :, :K-1] = state[r]; padded[r, :, K-1 + j] = x[starts[r] + j] for j < lens[r]
    padded = x.new_zeros(num_reqs, channels, k - 1 + max_len)
    padded[:, :, : k - 1] = state.to(x.dtype)
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=x.device), lens)
    pos = torch.arange(num_tokens, device=x.device) - starts[req_of_token]
    padded[req_of_token, :, k - 1 + pos] = x
    windows = padded.unfold(2, k, 1)  # [num_reqs, channels, max_len, K]
    y = (windows[req_of_token, :, pos] * weight).sum(-1)  # [num_tokens, channels]
    if bias is not None:
        y = y + bias
    # The new state: each request's last K-1 inputs (state included, for chunks shorter than K-1).
    tail = (lens.view(-1, 1) + torch.arange(k - 1, device=x.device)).view(num_reqs, 1, k - 1)
    state.copy_(padded.gather(2, tail.expand(num_reqs, channels, k - 1)).to(state.dtype))
    return y
