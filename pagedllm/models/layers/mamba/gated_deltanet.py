"""Qwen3-Next's Gated DeltaNet layer (transformers' Qwen3NextGatedDeltaNet) over the paged
state: in_proj_qkvz and in_proj_ba (their rows grouped per key head: q, k, then that group's
value heads' v and z; b, then a), a causal depthwise conv + SiLU over (q, k, v) continuing from
each request's conv state, l2-normalised q and k (each key head serving Hv / Hk value heads),
decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), the gated
delta rule (models/layers/mamba/gated_delta_rule.py) continuing from each request's state
[Hv, Dk, Dv], an RMSNorm per value head gated by silu(z), and out_proj.

A step of decodes only runs the one-token recurrence of every request at once; any other step
runs each request's chunk through the chunked rule (a loop over requests, not tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from pagedllm.models.layers.mamba.causal_conv1d import causal_conv1d
from pagedllm.models.layers.mamba.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from pagedllm.models.layers.mamba.state_layer import StateLayer


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Over the last axis, as transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(StateLayer):
    def __init__(self, hf: dict) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        self.hk, self.hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        self.dk, self.dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        if self.hv % self.hk:
            raise ValueError(
                f"linear_num_value_heads ({self.hv}) must be a multiple of linear_num_key_heads ({self.hk})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
        self.kernel = hf.get("linear_conv_kernel_dim", 4)
        self.eps = hf.get("rms_norm_eps", 1e-6)
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.make_projections(hidden)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.out_proj = ReplicatedLinear(self.value_dim, hidden, False)
        # One request's state: the conv's last K - 1 inputs, the delta-rule state of every value head.
        self.state_shapes = ((self.conv_dim, self.kernel - 1), (self.hv, self.dk, self.dv))

    def make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = ReplicatedLinear(hidden, 2 * self.key_dim + 2 * self.value_dim, False)
        self.in_proj_ba = ReplicatedLinear(hidden, 2 * self.hv, False)

    def split_projections(self, x: torch.Tensor):
        """x [T, hidden] -> mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]: the
        checkpoint's rows come per key head (q, k, v, z of its Hv / Hk value heads; b, a)."""
        T, r = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(T, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.hv, self.dv), b.reshape(T, self.hv), a.reshape(T, self.hv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the step's tokens, requests packed) -> [T, hidden]."""
        meta = self.step_state()
        T, r = x.shape[0], self.hv // self.hk
        mixed, z, b, a = self.split_projections(x)
        conv = self.load_state(meta, 0)  # [R, conv_dim, K-1] (a copy)
        mixed = F.silu(causal_conv1d(mixed, self.conv1d_weight[:, 0], None, conv, meta.query_start_loc))
        self.store_state(meta, 0, conv)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # [T, Hv, Dk]: each key head serves r consecutive value heads
        q = l2_normalize(q.reshape(T, self.hk, self.dk)).repeat_interleave(r, dim=1)
        k = l2_normalize(k.reshape(T, self.hk, self.dk)).repeat_interleave(r, dim=1)
        v = v.reshape(T, self.hv, self.dv).float()
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if meta.all_decode:
            s = self.load_state(meta, 1)  # [R, Hv, Dk, Dv]
            o = gated_delta_rule_step(q, k, v, g, beta, s)
            self.store_state(meta, 1, s)
        else:
            o = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)
            for i in range(len(meta.blocks)):
                s, e = meta.starts[i], meta.starts[i + 1]
                with self.request_state(meta, 1, i) as state:  # [Hv, Dk, Dv], updated in place
                    o[s:e] = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state)
        # RMSNorm per value head, then the gate (transformers' Qwen3NextRMSNormGated: from the
        # output in the model's dtype)
        o = o.to(x.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm_weight * o.to(x.dtype)) * F.silu(z.float())
        return self.out_proj(o.to(x.dtype).reshape(T, self.value_dim))


class FlatGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layer (transformers' Qwen3_5GatedDeltaNet): the same layer with its projections
    as four checkpoint matrices, in_proj_qkv (q of every key head, then k, then v), in_proj_z,
    in_proj_b, in_proj_a, loaded into one fused in_proj (shards 0-3)."""

    def make_projections(self, hidden: int) -> None:
        self.in_proj = MergedColumnParallelLinear(
            hidden, [range(self.conv_dim), range(self.value_dim), range(self.hv), range(self.hv)], False
        )

    def split_projections(self, x: torch.Tensor):
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        return mixed, z.reshape(x.shape[0], self.hv, self.dv), b, a
