"""Linear layers that hold one tensor-parallel rank's slice of a weight and load it themselves
(Megatron-LM style, as vLLM's model_executor/layers/linear.py).

Every parameter carries `weight_loader(param, loaded, shard_id=None)`: it cuts this rank's slice
out of the whole checkpoint tensor and, for a fused layer, places it at its shard's offset. The
slices are ranges of the global output (column) or input (row) features, planned by
distributed/sharding.py; they may differ in size between ranks (uneven heads) and overlap (a
KV head replicated on the ranks that share it). With one rank (comm None or of size 1) every
layer is a plain linear and nothing is communicated. How the product is computed is the
layer's LinearMethod (linear_method.py).

- ReplicatedLinear: the whole weight on every rank.
- ColumnParallelLinear: a range of the output features; no communication (each rank goes on
  with its own heads / intermediate slice).
- MergedColumnParallelLinear: several column-parallel matrices fused into one (gate/up),
  each with its own range; shard_id = the matrix's index.
- QKVParallelLinear: q, k, v fused (shard_id "q", "k", "v"), ranges by head.
- RowParallelLinear: a range of the input features (o_proj, down_proj); the partial products
  are summed over the TP group (all-reduce), then the bias is added once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from pagedllm.models.cpu_ops import cpu_ops
from pagedllm.models.layers.cpu_bf16_pair_linear import CPUBf16PairLinearMethod, pair_linear_supported
from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod, packed_linear_supported
from pagedllm.models.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedllm.models.layers.quantization import current_quant_config
from pagedllm.models.layers.weight_utils import copy_weight


def multi_rank(comm):
    """The tensor-parallel group where it has more than one rank, else None: at one rank a
    parallel layer is a plain one and calls no collective."""
    return comm if comm is not None and comm.size > 1 else None


def default_linear_method(lm_head: bool = False) -> LinearMethodBase:
    """The method for a layer built now: the current quantization config's (set by the loader);
    on the CPU in float32 / bfloat16, oneDNN-packed weights, or in bfloat16 where oneDNN has no
    bf16 kernels the pair-packed C++ kernel's (unless PAGEDLLM_CPU_PACKED_LINEAR=0); else F.linear."""
    quant = current_quant_config()
    if quant is not None:
        return quant.get_linear_method(lm_head)
    if torch.get_default_device().type == "cpu":
        dtype = torch.get_default_dtype()
        if packed_linear_supported(dtype):
            return CPUPackedLinearMethod(cpu_ops(), lm_head)
        if pair_linear_supported(dtype, cpu_ops()):
            return CPUBf16PairLinearMethod(cpu_ops())
    return UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W [output_size, input_size] this rank's part."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, linear_method: Optional[LinearMethodBase] = None
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.linear_method = linear_method or default_linear_method()
        self.linear_method.create_weights(self, input_size, output_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"method={type(self.linear_method).__name__}"
        )


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param, loaded, shard_id=None):
        copy_weight(param.data, loaded)


class MergedColumnParallelLinear(LinearBase):
    """Matrices i = 0, 1, ... stacked along the output features, this rank holding
    output_ranges[i] of matrix i."""

    def __init__(
        self,
        input_size: int,
        output_ranges: Sequence[range],
        bias: bool,
        linear_method: Optional[LinearMethodBase] = None,
    ) -> None:
        self.output_ranges = tuple(output_ranges)
        sizes = [len(r) for r in self.output_ranges]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]  # where each shard starts
        super().__init__(input_size, sum(sizes), bias, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError(f"a fused layer of {len(self.output_ranges)} matrices loads one at a time")
        r, at = self.output_ranges[shard_id], self.offsets[shard_id]
        copy_weight(param.data[at : at + len(r)], loaded[r.start : r.stop])


class ColumnParallelLinear(MergedColumnParallelLinear):
    """One matrix, this rank holding output_range of its output features."""

    def __init__(
        self, input_size: int, output_range: range, bias: bool, linear_method: Optional[LinearMethodBase] = None
    ) -> None:
        super().__init__(input_size, [output_range], bias, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, 0)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections fused; this rank holds query heads q_heads and KV heads kv_heads."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        q_heads: range,
        kv_heads: range,
        bias: bool,
        linear_method: Optional[LinearMethodBase] = None,
    ) -> None:
        q = range(q_heads.start * head_dim, q_heads.stop * head_dim)
        kv = range(kv_heads.start * head_dim, kv_heads.stop * head_dim)
        super().__init__(hidden_size, [q, kv, kv], bias, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, self.SHARDS[shard_id])


class RowParallelLinear(LinearBase):
    """This rank holds input_range of the input features (and the whole bias)."""

    def __init__(
        self,
        input_range: range,
        output_size: int,
        bias: bool,
        comm=None,
        linear_method: Optional[LinearMethodBase] = None,
    ) -> None:
        super().__init__(len(input_range), output_size, bias, linear_method)
        self.input_range = input_range
        self.comm = multi_rank(comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self.linear_method.apply(self, x, self.bias)
        y = self.comm.all_reduce(self.linear_method.apply(self, x))
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            copy_weight(param.data, loaded)
        elif hasattr(param, "input_slice"):  # columns that are not features (GGUF row blobs: bytes)
            copy_weight(param.data, param.input_slice(loaded, self.input_range))
        else:
            copy_weight(param.data, loaded[:, self.input_range.start : self.input_range.stop])
