"""EngineArgs: the user-facing knobs (shared by LLM, the CLI and the server) -> EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: Optional[str] = None          # None: the default model (built on first use)
    max_model_len: Optional[int] = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_memory: Optional[int] = None   # bytes
    num_gpu_blocks: Optional[int] = None    # overrides kv_cache_memory (tests, tuning)
    dtype: str = "auto"
    seed: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0             # GiB
    num_cpu_blocks: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None   # "mp" (default) or "ray"

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.models.download import resolve_model
        path = str(resolve_model(self.model))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 2):
            raise ValueError(f"num_gpu_blocks must be an integer >= 2, got {self.num_gpu_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a number of bytes >= 1, got {self.kv_cache_memory!r}")
        mc = ModelConfig.from_dir(path, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed)
        sc = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             max_model_len=mc.max_model_len,
                             chunked_prefill=self.enable_chunked_prefill,
                             preemption_mode=self.preemption_mode)
        cc = CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                         num_gpu_blocks=self.num_gpu_blocks,
                         enable_prefix_caching=self.enable_prefix_caching,
                         swap_space=self.swap_space, num_cpu_blocks=self.num_cpu_blocks)
        pc = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size,
                            data_parallel_size=self.data_parallel_size,
                            distributed_executor_backend=self.distributed_executor_backend)
        config = EngineConfig(mc, cc, sc, pc)
        config.validate()
        return config
