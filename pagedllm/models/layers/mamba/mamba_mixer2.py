"""Mamba2's mixer (transformers' Mamba2Mixer) over the paged state: one projection into
(gate z, xBC, dt), a causal depthwise conv + SiLU over xBC continuing from each request's conv
state, the selective state space (SSD) over x with B, C continuing from its SSM state, a gated
RMSNorm per group, and the output projection. Tokens of every request are packed on one axis;
a step of decodes only runs the one-token recurrence of all of them at once, any other step
runs each request's chunk through the chunked scan (a loop over requests, not tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.linear import ReplicatedLinear
from pagedllm.models.layers.mamba.causal_conv1d import causal_conv1d
from pagedllm.models.layers.mamba.ssd import ssd_chunk_scan, ssd_decode_step
from pagedllm.models.layers.mamba.state_layer import StateLayer


def json_float(v) -> float:
    """A config.json number; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


# Where the output's gate silu(z) goes: before the group RMSNorm (Mamba2, Granite-4.0-H), after
# it, or with no norm at all (Falcon-H1's mamba_norm_before_gate / mamba_rms_norm options).
GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY = "gate_then_norm", "norm_then_gate", "gate_only"


def gated_group_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float, order: str = GATE_THEN_NORM
) -> torch.Tensor:
    """y [T, I] times silu(gate), normalised over each of `groups` equal slices, in float32,
    then scaled (transformers' MambaRMSNormGated, norm after gate). order NORM_THEN_GATE: the
    gate multiplies the scaled norm, in float32 (FalconH1RMSNormGated); GATE_ONLY: y * silu(gate)."""
    if order == GATE_ONLY:
        return (y.float() * F.silu(gate.float())).to(y.dtype)
    h = y.float() * F.silu(gate.float()) if order == GATE_THEN_NORM else y.float()
    h = h.view(h.shape[0], groups, -1)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).view(y.shape)
    if order == NORM_THEN_GATE:
        return (weight.float() * h * F.silu(gate.float())).to(y.dtype)
    return weight * h.to(y.dtype)


class Mamba2Mixer(StateLayer):
    def __init__(self, hf: dict) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        self.num_heads, self.head_dim = hf["num_heads"], hf["head_dim"]
        self.intermediate = hf.get("d_ssm") or int(hf.get("expand", 2) * hidden)
        self.norm_order = hf.get("norm_order", GATE_THEN_NORM)
        self.n_groups, self.d_state = hf.get("n_groups", 8), hf.get("state_size", 128)
        self.kernel = hf.get("conv_kernel", 4)
        self.chunk_size = hf.get("chunk_size", 256)
        self.eps = hf.get("layer_norm_epsilon", 1e-5)
        self.dt_limit = tuple(map(json_float, hf.get("time_step_limit", (0.0, float("inf")))))
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.d_state
        bias = hf.get("use_bias", False)
        self.in_proj = ReplicatedLinear(hidden, self.intermediate + self.conv_dim + self.num_heads, bias)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.conv1d_bias = (
            nn.Parameter(torch.empty(self.conv_dim), requires_grad=False) if hf.get("use_conv_bias", True) else None
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm_weight = (
            nn.Parameter(torch.ones(self.intermediate), requires_grad=False) if self.norm_order != GATE_ONLY else None
        )  # no norm, no weight
        self.out_proj = ReplicatedLinear(self.intermediate, hidden, hf.get("out_bias", bias))
        # One request's state: the conv's last K - 1 inputs, the SSM state of every head.
        self.state_shapes = ((self.conv_dim, self.kernel - 1), (self.num_heads, self.head_dim, self.d_state))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the step's tokens, requests packed) -> [T, hidden]."""
        meta = self.step_state()
        T = x.shape[0]
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        conv = self.load_state(meta, 0)  # [R, conv_dim, K-1] (a copy)
        xbc = F.silu(causal_conv1d(xbc, self.conv1d_weight[:, 0], self.conv1d_bias, conv, meta.query_start_loc))
        self.store_state(meta, 0, conv)
        xs, B, C = xbc.split([self.intermediate, self.n_groups * self.d_state, self.n_groups * self.d_state], -1)
        xs = xs.reshape(T, self.num_heads, self.head_dim)
        B, C = B.reshape(T, self.n_groups, self.d_state), C.reshape(T, self.n_groups, self.d_state)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [T, H]
        A = -torch.exp(self.A_log.float())
        xs, B, C = xs.float(), B.float(), C.float()
        if meta.all_decode:
            s = self.load_state(meta, 1)  # [R, H, P, N]
            y = ssd_decode_step(xs, dt, A, B, C, self.D.float(), s)
            self.store_state(meta, 1, s)
        else:
            y = torch.empty_like(xs)
            for r in range(len(meta.blocks)):
                a, b = meta.starts[r], meta.starts[r + 1]
                with self.request_state(meta, 1, r) as s:  # [H, P, N], updated in place
                    y[a:b] = ssd_chunk_scan(xs[a:b], dt[a:b], A, B[a:b], C[a:b], self.D.float(), s, self.chunk_size)
        y = gated_group_rms_norm(
            y.reshape(T, self.intermediate).to(x.dtype),
            gate,
            self.norm_weight,
            self.n_groups,
            self.eps,
            self.norm_order,
        )
        return self.out_proj(y)
