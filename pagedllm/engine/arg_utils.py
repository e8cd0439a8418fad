"""EngineArgs: the user-facing knobs (shared by LLM, the CLI and the server) -> EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from pagedllm.config import (CUDAGRAPH_MODES, CacheConfig, DeviceConfig, EngineConfig, LoRAConfig, ModelConfig,
                             ParallelConfig, PoolerConfig, SchedulerConfig, SpeculativeConfig, cuda_graph_ladder,
                             mixed_graph_ladder, resolve_dtype)


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
    device: str = "auto"                # "auto" (cuda when torch sees one), "cpu", "cuda"
    attention_backend: str = "auto"     # "auto" (triton on cuda, torch on cpu), "torch", "triton"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False         # no CUDA graphs
    # CUDA graphs of decode steps only, or of mixed prefill + decode steps too (vLLM's name).
    cudagraph_mode: str = "FULL"
    runner: str = "generate"            # "generate", or "pooling" (embeddings; vLLM's --runner)
    enable_lora: bool = False           # serve LoRA adapters (pagedllm/lora)
    max_loras: int = 1                  # distinct adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None   # adapters kept in host memory (None: max_loras)
    # P/D disaggregation: vLLM's --kv-transfer-config (JSON text, a dict, or a KVTransferConfig).
    kv_transfer_config: Optional[object] = None
    quantization: Optional[str] = None  # CPU weights: models/layers/quantization/registry.py
    quantization_group_size: Optional[int] = None   # int4's / int8's group (32 by default; int8 -1: per channel)
    speculative_config: Optional[dict] = None   # SpeculativeConfig's fields (a dict or its JSON)
    kv_cache_dtype: str = "auto"        # "auto", "int8", "fp8" (= "fp8_e4m3"), "fp8_e5m2" (vLLM's)
    async_scheduling: bool = False      # schedule step N+1 while step N runs (vLLM's --async-scheduling)
    # "fcfs", or "priority": requests ordered by their priority (lower first), then arrival (vLLM's flag).
    scheduling_policy: str = "fcfs"
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none), or a folder
    # holding a generation_config.json (vLLM's --generation-config).
    generation_config: str = "auto"

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.models.download import resolve_model
        path = str(resolve_model(self.model, self.quantization))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 2):
            raise ValueError(f"num_gpu_blocks must be an integer >= 2, got {self.num_gpu_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a number of bytes >= 1, got {self.kv_cache_memory!r}")
        dc = self._device_config()
        mc = ModelConfig.from_dir(path, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed)
        mc.dtype = resolve_dtype(mc.dtype, mc.hf_config, dc.device)
        mc.runner = self.runner
        from pagedllm.engine.generation_defaults import load_sampling_defaults
        mc.sampling_defaults = load_sampling_defaults(self.generation_config, path)
        mc.set_quantization(self.quantization, self.quantization_group_size, dc.device)
        prefix_caching = self.enable_prefix_caching
        if self.runner == "pooling":
            mc.pooler_config = PoolerConfig.from_dir(path)
            # A mean needs every prompt token's hidden state: a cached prefix would skip some.
            prefix_caching = prefix_caching and mc.pooler_config.pooling_type == "LAST"
        sc = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             max_model_len=mc.max_model_len,
                             chunked_prefill=self.enable_chunked_prefill,
                             preemption_mode=self.preemption_mode,
                             async_scheduling=bool(self.async_scheduling),
                             scheduling_policy=self.scheduling_policy)
        from pagedllm.attention.kv_quant import check_kv_cache_dtype
        cc = CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                         num_gpu_blocks=self.num_gpu_blocks,
                         enable_prefix_caching=prefix_caching,
                         swap_space=self.swap_space, num_cpu_blocks=self.num_cpu_blocks,
                         cache_dtype=check_kv_cache_dtype(self.kv_cache_dtype))
        pc = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size,
                            data_parallel_size=self.data_parallel_size,
                            distributed_executor_backend=self.distributed_executor_backend)
        spec = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method in ("draft_model", "mtp"):   # drafts write K/V past the last token
            sc.num_lookahead_tokens = spec.num_speculative_tokens
        lc = (LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
              if self.enable_lora else None)
        config = EngineConfig(mc, cc, sc, pc, dc, lc, speculative_config=spec)
        if self.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer.config import KVTransferConfig
            config.kv_transfer_config = KVTransferConfig.from_cli(self.kv_transfer_config)
            config.kv_transfer_config.resolve_port()
        config.validate()
        return config

    def _device_config(self) -> DeviceConfig:
        """'auto' resolved; other bad values are refused by EngineConfig.validate."""
        device = resolve_device(self.device)
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        if backend == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ValueError("attention_backend 'triton' needs the triton package "
                                 "(pip install triton)") from None
        mode = str(self.cudagraph_mode).upper()
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                             f"got {self.cudagraph_mode!r}")
        graphs = device == "cuda" and not self.enforce_eager and mode != "NONE"
        mixed = graphs and mode == "FULL"
        return DeviceConfig(device=device, attention_backend=backend,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            enforce_eager=bool(self.enforce_eager),
                            cuda_graph_sizes=cuda_graph_ladder(self.max_num_seqs) if graphs else [],
                            mixed_graph_sizes=mixed_graph_ladder(self.max_num_batched_tokens) if mixed else [])


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without one is a ValueError."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use device 'cpu' or 'auto'")
    return device
