"""The gated delta rule (Gated DeltaNet: Qwen3-Next / Qwen3.5's linear-attention layers) for one
head, token t, with a state S [d_k, d_v]:
    S = exp(g[t]) * S                                   (decay; g <= 0)
    S = S + k[t] (outer) beta[t] * (v[t] - S^T k[t])    (the delta rule: overwrite what k maps to)
    o[t] = S^T (scale * q[t])

Prefill runs it in chunks. Inside a chunk of L tokens, with G[t] = exp(cumsum(g)[t]) and S0 the
state the chunk starts from, each token's write d[t] = beta[t] (v[t] - G[t] S0^T k[t]
- sum_{j<t} G[t]/G[j] (k[t].k[j]) d[j]) is one unit lower-triangular solve for the whole chunk:
    (I + diag(beta) Lk) D = diag(beta) (V - diag(G) K S0),   Lk[t,j] = G[t]/G[j] k[t].k[j], j < t
and then the outputs and the next state are products:
    O = diag(G) Q S0 + (G[t]/G[j] q[t].k[j])_{j<=t} D,   S = G[L] S0 + (K * G[L]/G)^T D.
Every exponent is a decay between two positions (<= 0), so nothing overflows. Across chunks
only S is carried, so a request's chunked prefill continues from the state its last chunk left.
Decode is the one-token recurrence over every request at once. All in float32.
"""

from __future__ import annotations

from typing import Optional

import torch


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """One request's tokens: q, k [T, H, Dk]; v [T, H, Dv]; g (log decay) and beta [T, H];
    state [H, Dk, Dv], updated in place -> o [T, H, Dv] (float32)."""
    dk, dv = q.shape[-1], v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    # [H, T, D] / [H, T]: the heads are the batch of every product below.
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    q = q * scale
    g, beta = g.float().t(), beta.float().t()
    s = state.float()
    out = []
    for start in range(0, q.shape[1], chunk_size):  # chunks of one request
        qs, ks, vs = (t[:, start : start + chunk_size] for t in (q, k, v))
        gs, bs = g[:, start : start + chunk_size], beta[:, start : start + chunk_size]
        L = qs.shape[1]
        cum = gs.cumsum(-1)  # [H, L]: log G, decreasing
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, L, L]
        lower = (ks @ ks.transpose(-1, -2) * decay).tril(-1) * bs[..., None]
        eye = torch.eye(L, dtype=q.dtype, device=q.device)
        rhs = torch.cat([vs, ks * cum.exp()[..., None]], dim=-1) * bs[..., None]  # [H, L, Dv + Dk]
        u, w = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
        d = u - w @ s  # [H, L, Dv]: each token's write
        o = (qs * cum.exp()[..., None]) @ s + (qs @ ks.transpose(-1, -2) * decay) @ d
        last = (cum[:, -1:] - cum).exp()[..., None]  # [H, L, 1]: decay to the chunk's end
        s = s * cum[:, -1].exp()[:, None, None] + (ks * last).transpose(-1, -2) @ d
        out.append(o.transpose(0, 1))
    if s is not state:
        state.copy_(s)
    return torch.cat(out)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """One token of N requests: q, k [N, H, Dk]; v [N, H, Dv]; g, beta [N, H]; state [N, H, Dk, Dv]
    (rows of the state cache), updated in place -> o [N, H, Dv] (float32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = state.float()
    k = k.float()
    s.mul_(g.float().exp()[..., None, None])
    recalled = (k.unsqueeze(-2) @ s).squeeze(-2)  # [N, H, Dv]: S^T k
    s.add_(k.unsqueeze(-1) * ((v.float() - recalled) * beta.float()[..., None]).unsqueeze(-2))
    if s is not state:
        state.copy_(s)
    return ((q.float() * scale).unsqueeze(-2) @ s).squeeze(-2)
