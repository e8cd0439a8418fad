"""Each config class checks its own fields: a bad value is a ValueError naming the field and
what is allowed (messages written out by hand); the defaults pass."""

from __future__ import annotations

import pytest

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def _model(**kw):
    return ModelConfig(model="/none", hf_config={"num_hidden_layers": 2}, **kw)


@pytest.mark.parametrize(
    "config, message",
    [
        (_model(runner="embed"), "runner must be 'generate' or 'pooling', got 'embed'"),
        (CacheConfig(block_size=24), "block_size must be a power of two in [1, 128], got 24"),
        (
            CacheConfig(cache_dtype="fp4"),
            "kv_cache_dtype must be one of auto, bfloat16, int8, fp8, fp8_e4m3, fp8_e5m2, got 'fp4'",
        ),
        (CacheConfig(swap_space=-1), "swap_space must be a number of GiB >= 0, got -1"),
        (SchedulerConfig(preemption_mode="drop"), "preemption_mode must be 'recompute' or 'swap', got 'drop'"),
        (
            SchedulerConfig(scheduling_policy="lifo"),
            "scheduling_policy must be one of ('fcfs', 'priority'), got 'lifo'",
        ),
        (SchedulerConfig(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        (
            SchedulerConfig(chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
            "without chunked prefill, max_num_batched_tokens (512) must be >= max_model_len (1024)",
        ),
        (ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
        (ParallelConfig(data_parallel_size=True), "data_parallel_size must be an integer >= 1, got True"),
        (
            ParallelConfig(distributed_executor_backend="mpi"),
            "distributed_executor_backend must be 'mp' or 'ray', got 'mpi'",
        ),
        (DeviceConfig(device="tpu"), "device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
        (DeviceConfig(gpu_memory_utilization=0), "gpu_memory_utilization must be in (0, 1], got 0"),
        (LoRAConfig(max_lora_rank=0), "max_lora_rank must be an integer >= 1, got 0"),
        (LoRAConfig(max_loras=2, max_cpu_loras=1), "max_cpu_loras must be an integer >= max_loras (2), got 1"),
        (
            SpeculativeConfig(num_speculative_tokens=17),
            "speculative_config.num_speculative_tokens must be an integer in [1, 16], got 17",
        ),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else "",
)
def test_a_bad_field_is_refused_by_its_class(config, message):
    with pytest.raises(ValueError) as e:
        config.validate()
    assert str(e.value) == message


@pytest.mark.parametrize(
    "config",
    [_model(), CacheConfig(), SchedulerConfig(), ParallelConfig(), DeviceConfig(), LoRAConfig(), SpeculativeConfig()],
    ids=lambda c: type(c).__name__,
)
def test_the_defaults_pass(config):
    config.validate()
