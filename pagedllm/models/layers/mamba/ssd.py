"""Mamba2's selective state space (SSD) for one head h, token t:
    state = exp(dt[t,h] * A[h]) * state + dt[t,h] * x[t,h] (outer) B[t,g(h)]
    y[t,h] = state @ C[t,g(h)] + D[h] * x[t,h]
with state [head_dim, d_state] per head and B, C shared by the heads of a group.

Prefill runs it in chunks (the SSD form): inside a chunk the outputs are one masked, decayed
attention-like product; across chunks only the state is carried, so a request's chunked
prefill continues from the state its last chunk left. Decode is the one-token recurrence over
every request at once.
"""

from __future__ import annotations

import torch


def _heads(bc: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., groups, d_state] -> [..., heads, d_state] (each group's row for its heads)."""
    return bc.repeat_interleave(num_heads // bc.shape[-2], dim=-2)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """One request's tokens: x [T, H, P]; dt [T, H] (after softplus); A [H] (negative); B, C
    [T, G, N]; D [H]; state [H, P, N], updated in place -> y [T, H, P]."""
    num_heads = x.shape[1]
    B, C = _heads(B, num_heads), _heads(C, num_heads)  # [T, H, N]
    s = state.to(x.dtype)
    out = []
    for start in range(0, x.shape[0], chunk_size):  # chunks of one request
        xs, dts, Bs, Cs = (t[start : start + chunk_size] for t in (x, dt, B, C))
        cum = torch.cumsum(dts * A, dim=0)  # [L, H], decreasing
        diff = cum[:, None] - cum[None]  # [L(t), L(s), H]
        causal = torch.ones(diff.shape[:2], dtype=torch.bool, device=x.device).tril()
        decay = torch.where(causal[..., None], diff, float("-inf")).exp()
        scores = torch.einsum("thn,shn->tsh", Cs, Bs) * decay * dts[None]  # [L, L, H]
        y = torch.einsum("tsh,shp->thp", scores, xs)
        y = y + torch.einsum("thn,hpn->thp", Cs, s) * cum.exp()[..., None]  # the carried state
        last = (cum[-1:] - cum).exp() * dts  # [L, H]: each token's weight at the end
        s = s * cum[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", last, xs, Bs)
        out.append(y + D[:, None] * xs)
    state.copy_(s.to(state.dtype))
    return torch.cat(out) if out else x.new_zeros(x.shape)


def ssd_decode_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of R requests: x [R, H, P]; dt [R, H]; B, C [R, G, N]; state
    [R, H, P, N], updated in place -> y [R, H, P]."""
    num_heads = x.shape[1]
    B, C = _heads(B, num_heads), _heads(C, num_heads)  # [R, H, N]
    s = state.to(x.dtype) * (dt * A).exp()[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None]
    state.copy_(s.to(state.dtype))
    return torch.einsum("rhpn,rhn->rhp", s, C) + D[:, None] * x
