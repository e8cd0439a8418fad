"""Which part of a Llama-family model each rank holds. Plain Python (no torch): the plan is
computed, validated and tested without starting a process.

Ranks are laid out as vLLM does: global rank = pp_rank * tp_size + tp_rank; rank 0 (stage 0,
TP rank 0) is the driver, which also runs the scheduler and samples.

Tensor parallelism divides attention by KV head, never a KV head's K/V projection, so that
every rank's attention is plain grouped-query attention over its own KV heads:

- num_kv_heads >= tp_size: rank r takes a contiguous range of KV heads with their whole query
  groups; when tp_size does not divide num_kv_heads the ranges differ by one head (SmolLM2's
  3 KV heads over 2 ranks: rank 0 takes 1 KV head and 3 query heads, rank 1 takes 2 and 6;
  the driver, which also schedules and samples, takes the smaller share).
- num_kv_heads < tp_size: each rank holds one KV head, replicated on the ranks that share it
  (they all compute and cache the same K/V), and those ranks split its query group.

The MLP's intermediate dimension and the vocabulary are split into contiguous ranges that
differ by at most one. Pipeline stages take contiguous ranges of layers. The embedding and the
LM head live on stage 0 (the driver samples, and tied embeddings need the weight only once);
the final norm lives on the last stage, which hands the hidden states of the rows that sample
back to stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.models.hf_config import head_dim_of


def split_range(n: int, parts: int, index: int) -> range:
    """The index-th of `parts` contiguous ranges covering [0, n); sizes differ by at most one,
    the smaller ones first."""
    return range(index * n // parts, (index + 1) * n // parts)


@dataclass(frozen=True)
class TPShard:
    """One tensor-parallel rank's share of every layer (global indices)."""

    tp_rank: int
    tp_size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range


@dataclass(frozen=True)
class ModelShard:
    """One rank's part of the model: its TP share and its pipeline stage's layers."""

    tp: TPShard
    pp_rank: int
    pp_size: int
    layers: range
    head_dim: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_kv_heads(self) -> int:
        return len(self.tp.kv_heads)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def plan_tp_shard(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, tp_size: int, tp_rank: int
) -> TPShard:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = split_range(num_kv_heads, tp_size, tp_rank)
        q = range(kv.start * group, kv.stop * group)
    else:
        # Ranks sharing one KV head are contiguous: rank r holds KV head r * n_kv // tp.
        head = tp_rank * num_kv_heads // tp_size
        sharers = [r for r in range(tp_size) if r * num_kv_heads // tp_size == head]
        if len(sharers) > group:
            raise ValueError(
                f"tensor_parallel_size {tp_size} is too large for this model: {len(sharers)} ranks "
                f"would share a KV head whose query group has only {group} heads "
                f"({num_heads} query heads, {num_kv_heads} KV heads)"
            )
        part = split_range(group, len(sharers), sharers.index(tp_rank))
        kv = range(head, head + 1)
        q = range(head * group + part.start, head * group + part.stop)
    return TPShard(
        tp_rank,
        tp_size,
        q,
        kv,
        split_range(intermediate_size, tp_size, tp_rank),
        split_range(vocab_size, tp_size, tp_rank),
    )


def plan_model_shard(hf_config: dict, tp_size: int, pp_size: int, rank: int) -> ModelShard:
    """The shard of global rank `rank` (= pp_rank * tp_size + tp_rank)."""
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    head_dim = head_dim_of(hf_config)
    num_layers = hf_config["num_hidden_layers"]
    validate_parallel_sizes(hf_config, tp_size, pp_size)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp = plan_tp_shard(
        num_heads, num_kv_heads, hf_config["intermediate_size"], hf_config["vocab_size"], tp_size, tp_rank
    )
    return ModelShard(tp, pp_rank, pp_size, split_range(num_layers, pp_size, pp_rank), head_dim)


def validate_parallel_sizes(hf_config: dict, tp_size: int, pp_size: int) -> None:
    """ValueError naming the size and the model's limit, before any process starts."""
    for name, v in (("tensor_parallel_size", tp_size), ("pipeline_parallel_size", pp_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    num_layers = hf_config["num_hidden_layers"]
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} layers")
    num_heads = hf_config["num_attention_heads"]
    if tp_size > num_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} is larger than the model's {num_heads} query heads")
    for name in ("intermediate_size", "vocab_size"):
        if tp_size > hf_config[name]:
            raise ValueError(f"tensor_parallel_size {tp_size} is larger than {name} {hf_config[name]}")
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    for r in range(tp_size):  # raises for a rank whose query share would be empty
        plan_tp_shard(num_heads, num_kv_heads, hf_config["intermediate_size"], hf_config["vocab_size"], tp_size, r)
