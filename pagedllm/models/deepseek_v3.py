"""DeepSeek-V3: multi-head latent attention over a latent KV cache, dense first layers then
DeepSeekMoE (models/layers/fused_moe.py's experts and grouped_topk), on the Llama family's
skeleton (embedding, stage layers, final norm, LM head, the loading loop: models/llama.py).

Attention (MLA, attention/mla_attention.py): the query comes from q_proj, or through a low
rank (q_a_proj -> q_a_layernorm -> q_b_proj); kv_a_proj_with_mqa gives the latent c_kv
[kv_lora_rank] (then kv_a_layernorm) and one RoPE key k_pe [qk_rope_head_dim] shared by the
heads; the cache keeps only [c_kv, k_pe]; kv_b_proj up-projects c_kv into each head's k_nope
[qk_nope_head_dim] and v [v_head_dim]. RoPE touches only the qk_rope_head_dim part.

RoPE layout: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3)...
(`rope_interleave`, transformers' default for V3), and transformers' output lists the rotated
evens, then the odds. Permuting the rope rows of q_(b_)proj and kv_a_proj_with_mqa at load
(evens first) turns that into the rotate-half RoPE the engine already has, with the same
values: no interleaved kernel, and the cache's k_pe equals transformers' cached one.

The MTP layers (model.layers.{num_hidden_layers}...) belong to models/deepseek_mtp.py; this
model skips them when it loads.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.mla_attention import MLAAttention
from pagedllm.distributed.sharding import TPShard, split_range
from pagedllm.models.layers.fused_moe import FusedMoE, expert_intermediate_range
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, multi_rank
from pagedllm.models.layers.linear_method import UnquantizedLinearMethod
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

# transformers' DeepseekV3RMSNorm default: the q/kv low-rank norms do not take rms_norm_eps
LORA_NORM_EPS = 1e-6


def mla_softmax_scale(hf: dict) -> float:
    """1/sqrt(qk_nope + qk_rope), times mscale^2 under yarn RoPE with mscale_all_dim
    (transformers' yarn_apply_mscale)."""
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def deinterleave_rope_rows(w: torch.Tensor, group: int, rope_dim: int) -> torch.Tensor:
    """Rows in groups of `group` (a head, or the whole kv_a output) whose last rope_dim rows are
    interleaved RoPE pairs -> the same rows with those listed evens first, then odds."""
    lead = group - rope_dim
    perm = torch.cat((torch.arange(lead), lead + torch.arange(0, rope_dim, 2), lead + torch.arange(1, rope_dim, 2)))
    return w.view(-1, group, *w.shape[1:])[:, perm].reshape(w.shape)


class DeepseekV3Attention(nn.Module):
    """MLA with this rank's heads (tp.q_heads); the latent projections are whole on every rank
    (every rank caches the same latents, as vLLM's MLA under TP)."""

    def __init__(self, hf: dict, tp: TPShard, comm=None) -> None:
        super().__init__()
        hidden, bias = hf["hidden_size"], hf.get("attention_bias", False)
        self.num_heads = len(tp.q_heads)
        self.dn, self.dr, self.dv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.kv_lora_rank, self.q_lora_rank = hf["kv_lora_rank"], hf.get("q_lora_rank")
        h0, h1 = tp.q_heads.start, tp.q_heads.stop

        def heads(d):  # this rank's output features of a per-head projection of width d
            return range(h0 * d, h1 * d)

        qk = self.dn + self.dr
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads(qk), False)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads(qk), False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.dr, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        # Never called as a linear: its plain weight is W_UK / W_UV (decode absorbs them) and
        # the prefill's up-projection, so it keeps F.linear's layout (no packing).
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads(self.dn + self.dv), False, UnquantizedLinearMethod()
        )
        self.o_proj = RowParallelLinear(heads(self.dv), hidden, bias, comm)
        self.mla_attn = MLAAttention(
            self.num_heads, mla_softmax_scale(hf), self.kv_lora_rank, self.dn, self.dr, self.dv
        )

    def forward(self, x, positions, rope):
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.num_heads, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.dr], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())  # [T, R]
        q_pe, k_pe = rope(positions, q_pe.contiguous(), k_pe.contiguous().view(T, 1, self.dr))
        o = self.mla_attn(q_nope, q_pe, kv_c, k_pe.view(T, self.dr), self.kv_b_proj.weight)
        return self.o_proj(o.reshape(T, self.num_heads * self.dv))


class DeepseekV3Gate(nn.Module):
    """The router: logits in float32 (as transformers computes them) and the expert-score
    correction bias [E], which only chooses experts (FusedMoE's grouped_topk)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [T, E]


class DeepseekV3MoE(nn.Module):
    """DeepSeekMoE: n_shared_experts always-on experts (one MLP of n_shared * moe_intermediate)
    plus the routed experts (sigmoid scores, group-limited top-k, routed_scaling_factor). Both
    leave their partial sums unreduced; the layer all-reduces once over the TP group."""

    def __init__(self, hf: dict, tp: TPShard, comm=None) -> None:
        super().__init__()
        hidden, moe_i = hf["hidden_size"], hf["moe_intermediate_size"]
        num_experts = hf["n_routed_experts"]
        self.gate = DeepseekV3Gate(hidden, num_experts)
        self.experts = FusedMoE(
            num_experts,
            hf["num_experts_per_tok"],
            hidden,
            expert_intermediate_range(moe_i, tp),
            comm,
            renormalize=bool(hf.get("norm_topk_prob", True)),
            reduce_results=False,
            use_grouped_topk=True,
            num_expert_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            scoring_func=hf.get("scoring_func", "sigmoid"),
            e_score_correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        )
        shared = moe_i * hf.get("n_shared_experts", 1)
        self.shared_experts = (
            LlamaMLP(hidden, split_range(shared, tp.tp_size, tp.tp_rank), False, None) if shared else None
        )
        self.comm = multi_rank(comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.comm.all_reduce(out) if self.comm is not None else out


class DeepseekV3DecoderLayer(nn.Module):
    """Dense MLP in the first `first_k_dense_replace` layers, DeepSeekMoE after."""

    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        super().__init__()
        eps, hidden = hf.get("rms_norm_eps", 1e-6), hf["hidden_size"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DeepseekV3Attention(hf, tp, comm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        dense = layer_idx < hf.get("first_k_dense_replace", 0) or not hf.get("n_routed_experts")
        self.mlp = LlamaMLP(hidden, tp.intermediate, False, comm) if dense else DeepseekV3MoE(hf, tp, comm)

    # The Llama layer's residual-stream protocol (LlamaForCausalLM.forward): same four parts.
    forward = LlamaDecoderLayer.forward


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    # No q/k/v stacking: MLA's projections load as they are (".q_proj" must stay q_proj).
    stacked_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    decoder_layer = DeepseekV3DecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        check_mla_config(hf)
        super().__init__(hf, max_positions, parallel)

    def weight_name_mapping(self):
        return deepseek_weight_name_mapping(self.hf)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.hf["num_hidden_layers"]
        # model.layers.{n + k}: the k-th MTP module's (models/deepseek_mtp.py)
        main = ((name, t) for name, t in weights if layer_index(name) is None or layer_index(name) < n)
        return super().load_weights(deinterleave_rope(self.hf, main))


MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla_config(hf: dict) -> None:
    """ValueError naming a missing or non-positive MLA dimension of config.json."""
    for name in MLA_FIELDS:
        v = hf.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"config.json's {name} must be an integer >= 1 for a DeepSeek-V3 model, got {v!r}")
    if hf["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"config.json's qk_rope_head_dim must be even (RoPE rotates pairs), got {hf['qk_rope_head_dim']}"
        )


def deepseek_weight_name_mapping(hf: dict) -> list[tuple[str, str, object]]:
    """(our name part, checkpoint part, shard id): routed experts into FusedMoE, gate/up stacked."""
    experts = FusedMoE.make_expert_params_mapping(hf.get("n_routed_experts") or 0)
    return [
        (f".mlp{ours}", f".mlp{ckpt}", sid) for ours, ckpt, sid in experts
    ] + DeepseekV3ForCausalLM.stacked_params_mapping


def layer_index(name: str):
    """i of a checkpoint name model.layers.{i}...., else None."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def deinterleave_rope(hf: dict, weights) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights with interleaved RoPE rows listed evens first, where the config's RoPE is
    interleaved (module docstring)."""
    interleaved = hf.get("rope_interleave", True)
    for name, t in weights:
        yield name, rope_rows_deinterleaved(hf, name, t) if interleaved else t


def rope_rows_deinterleaved(hf: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor with its interleaved RoPE rows listed evens first (identity for any
    tensor without RoPE rows)."""
    dr = hf["qk_rope_head_dim"]
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        return deinterleave_rope_rows(t, hf["qk_nope_head_dim"] + dr, dr)
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        return deinterleave_rope_rows(t, hf["kv_lora_rank"] + dr, dr)
    return t
