"""Mixture-of-experts layer (vLLM's FusedMoE): the routed experts of one MoE block, their weights
stacked, tensor-parallel by intermediate columns.

Interface
- `FusedMoE(num_experts, top_k, hidden_size, intermediate, comm=None, renormalize=True,
  reduce_results=True, use_grouped_topk=False, num_expert_group=None, topk_group=None,
  scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0)`.
  intermediate: this rank's range of each expert's intermediate features
  (`expert_intermediate_range(size, tp)`); comm: the TP group (None: one rank).
  Parameters: `w13_weight` [E, 2 * I_local, H] (gate rows, then up rows) and `w2_weight`
  [E, H, I_local], each with `weight_loader(param, loaded, shard_id)`, shard_id =
  (expert_id, "w1" | "w3" | "w2") for the checkpoint's gate / up / down matrix of one expert.
  - `forward(hidden [T, H], router_logits [T, E]) -> [T, H]`: routes (`select_experts`), then
    `apply_experts`.
  - `select_experts(router_logits) -> (topk_weights [T, k] float32, topk_ids [T, k] int64)`:
    `fused_topk` or, with use_grouped_topk, `grouped_topk` (the DeepSeek-V3 rule).
  - `apply_experts(hidden, topk_weights, topk_ids) -> [T, H]`: sum_k w_k * expert_k(x), summed
    over the TP group unless reduce_results=False (the caller all-reduces once after adding
    its shared experts).
  - `FusedMoE.make_expert_params_mapping(num_experts, gate="gate_proj", down="down_proj",
    up="up_proj")`: [(param part, checkpoint part, shard_id)] for the model's load_weights:
    "experts.{e}.gate_proj." -> "experts.w13_" with shard (e, "w1"); Mixtral passes w1 / w2 / w3.
- Routing functions (plain functions, so DeepSeek's gate can call them itself):
  - `fused_topk(router_logits, top_k, renormalize)`: softmax in float32, top-k, optionally
    renormalised to sum 1 (Mixtral always, Qwen3-MoE per `norm_topk_prob`).
  - `grouped_topk(router_logits, top_k, num_expert_group, topk_group, renormalize,
    e_score_correction_bias=None, routed_scaling_factor=1.0, scoring_func="sigmoid")`:
    DeepSeek-V3: scores = sigmoid(logits); the bias is added for selection only; experts in
    n_group groups, a group scored by the sum of its top-2 biased scores; the best topk_group
    groups kept; top-k of the biased scores in them; weights are the unbiased scores,
    renormalised, times routed_scaling_factor.

The experts are computed by grouping the (token, expert) assignments per expert: sort by
expert id, then one matmul per active expert over its tokens (a loop over experts, never over
tokens) on the CPU; on a GPU one grouped Triton kernel launch per matrix
(fused_moe_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.sharding import TPShard, split_range
from pagedllm.models.layers.activation import SiluAndMul
from pagedllm.models.layers.linear import multi_rank
from pagedllm.models.layers.weight_utils import copy_weight


# ------------------------------------------------------------------------------------- routing
def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k: router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (DeepSeek-V3): router_logits [T, E] -> (weights [T, k] float32,
    ids [T, k] int64). The correction bias [E] only chooses experts; the weights are the
    unbiased scores."""
    if scoring_func == "sigmoid":
        scores = router_logits.float().sigmoid()
    elif scoring_func == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")
    T, E = scores.shape
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = choice.view(T, num_expert_group, E // num_expert_group)  # [T, G, E/G]
    if e_score_correction_bias is None:
        group_scores = grouped.max(dim=-1).values  # [T, G]
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(T, E)
    ids = choice.masked_fill(expert_mask == 0, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def expert_intermediate_range(intermediate_size: int, tp: TPShard) -> range:
    """This rank's contiguous range of every expert's intermediate features."""
    return split_range(intermediate_size, tp.tp_size, tp.tp_rank)


# ------------------------------------------------------------------------------ expert compute
def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [T*k]: the flat (token, slot) assignments grouped by expert,
    stable; counts [E]: assignments per expert)."""
    flat = topk_ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def fused_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(act(gate_up_e(hidden[t]))) for e = topk_ids[t, k]:
    hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]. One matmul pair per active expert over
    the rows routed to it."""
    T, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    tokens = order // k  # [T*k] token of each sorted assignment
    x = hidden[tokens]  # [T*k, H] grouped by expert
    out = torch.empty(T * k, w2.shape[1], dtype=hidden.dtype, device=hidden.device)  # [T*k, H]
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host sync for the counts
        if n:
            rows = slice(start, start + n)
            out[rows] = F.linear(act_fn(F.linear(x[rows], w13[e])), w2[e])
            start += n
    out *= topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, tokens, out)


class FusedMoE(nn.Module):
    """The routed experts of one MoE block (interface in the module docstring)."""

    SHARDS = ("w1", "w2", "w3")

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate: range,
        comm=None,
        renormalize: bool = True,
        reduce_results: bool = True,
        use_grouped_topk: bool = False,
        num_expert_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        scoring_func: str = "softmax",
        e_score_correction_bias: Optional[torch.Tensor] = None,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts), got {top_k}")
        if use_grouped_topk and (
            not num_expert_group or num_experts % num_expert_group or not 1 <= (topk_group or 0) <= num_expert_group
        ):
            raise ValueError(
                f"n_group ({num_expert_group}) must divide n_routed_experts "
                f"({num_experts}) and topk_group ({topk_group}) be in [1, n_group]"
            )
        if len(intermediate) == 0:
            raise ValueError(
                f"tensor_parallel_size is larger than the experts' intermediate size: "
                f"this rank's share of it is empty ({intermediate})"
            )
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate = intermediate
        I = len(intermediate)
        self.comm = multi_rank(comm) if reduce_results else None
        self.renormalize, self.use_grouped_topk = renormalize, use_grouped_topk
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.scoring_func, self.routed_scaling_factor = scoring_func, routed_scaling_factor
        # The gate's parameter [E], not ours: kept out of our parameters (a Parameter assigned to
        # a Module registers itself), so that it is named and loaded once, as the gate's.
        object.__setattr__(self, "e_score_correction_bias", e_score_correction_bias)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * I, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, I), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()

    @staticmethod
    def make_expert_params_mapping(
        num_experts: int, gate: str = "gate_proj", down: str = "down_proj", up: str = "up_proj"
    ) -> list[tuple[str, str, tuple[int, str]]]:
        """(our name part, checkpoint name part, shard_id) for every expert matrix."""
        return [
            (".experts.w13_" if shard in ("w1", "w3") else ".experts.w2_", f".experts.{e}.{name}.", (e, shard))
            for e in range(num_experts)
            for shard, name in (("w1", gate), ("w2", down), ("w3", up))
        ]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """One expert's whole checkpoint matrix (gate / up [I, H], down [H, I]) -> its slice."""
        if not (
            isinstance(shard_id, tuple)
            and len(shard_id) == 2
            and shard_id[1] in self.SHARDS
            and 0 <= shard_id[0] < self.num_experts
        ):
            raise ValueError(
                f"expert shard must be (expert id < {self.num_experts}, one of {self.SHARDS}), got {shard_id!r}"
            )
        e, shard = shard_id
        r, I = self.intermediate, len(self.intermediate)
        if shard == "w2":
            copy_weight(param.data[e], loaded[:, r.start : r.stop])
        else:
            at = 0 if shard == "w1" else I
            copy_weight(param.data[e, at : at + I], loaded[r.start : r.stop])

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_grouped_topk:
            return grouped_topk(
                router_logits,
                self.top_k,
                self.num_expert_group,
                self.topk_group,
                self.renormalize,
                self.e_score_correction_bias,
                self.routed_scaling_factor,
                self.scoring_func,
            )
        weights, ids = fused_topk(router_logits, self.top_k, self.renormalize)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def apply_experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda:
            from pagedllm.models.layers.fused_moe_triton import fused_experts_triton

            out = fused_experts_triton(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            out = fused_experts_torch(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.act_fn)
        return self.comm.all_reduce(out) if self.comm is not None else out

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H]."""
        return self.apply_experts(hidden, *self.select_experts(router_logits))

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={len(self.intermediate)}, grouped={self.use_grouped_topk}"
        )
