"""EngineArgs: the user-facing knobs (shared by LLM, the CLI and the server) -> EngineConfig.

Each field carries its flag (engine/cli_fields.py): the engine CLI is generated from this class,
so a new engine knob is one field here (and its use in create_engine_config)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Optional

from pagedllm.attention.backends.registry import backend_choices
from pagedllm.config import (
    CUDAGRAPH_MODES,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    RUNNERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    cuda_graph_ladder,
    mixed_graph_ladder,
    resolve_dtype,
)
from pagedllm.engine.cli_fields import arg
from pagedllm.engine.compat import check_compatibility
from pagedllm.models.hf_config import bidirectional_image_tokens
from pagedllm.models.model_config_loader import model_config_from_dir, set_quantization


def _quantization_choices() -> list[str]:
    from pagedllm.models.layers.quantization.registry import quantization_choices

    return quantization_choices()


def _attention_backend_choices() -> tuple[str, ...]:
    return ("auto", *backend_choices())


def _speculative_config(text: str) -> dict:
    """--speculative-config: checked at parse time, so a bad one is an argparse error naming the field."""
    try:
        SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def _limit_mm_per_prompt(text: str) -> dict:
    """--limit-mm-per-prompt: checked at parse time (an argparse error naming the modality)."""
    from pagedllm.multimodal.limits import parse_limit_mm_per_prompt

    try:
        return parse_limit_mm_per_prompt(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gib_to_bytes(gib: float) -> int:
    return int(gib * 2**30)


@dataclass
class EngineArgs:
    model: Optional[str] = arg(None, "HF-format model directory (default: SmolLM2-135M-Instruct, built on first use)")
    max_model_len: Optional[int] = arg(None, "context length (default: the model's)")
    block_size: int = arg(16, "tokens per KV-cache block")
    max_num_seqs: int = arg(128, "most requests in one step")
    max_num_batched_tokens: int = arg(2048, "token budget of one step")
    # Bytes here; GiB on the command line.
    kv_cache_memory: Optional[int] = arg(None, "GiB for the KV cache (default 4)", type=float, from_cli=_gib_to_bytes)
    # Overrides kv_cache_memory (tests, tuning).
    num_gpu_blocks: Optional[int] = arg(None, cli=False)
    dtype: str = arg(
        "auto", "weights and activations (default auto: float32 on cpu, the config's on cuda)", choices=DTYPES
    )
    seed: int = arg(0, "the engine's random seed")
    enable_chunked_prefill: bool = arg(True, "turn chunked prefill off")
    enable_prefix_caching: bool = arg(True, "turn automatic prefix caching off")
    preemption_mode: str = arg("recompute", "what a preempted request's KV cache does", choices=PREEMPTION_MODES)
    swap_space: float = arg(4.0, "GiB of CPU swap space (default 4)")
    num_cpu_blocks: Optional[int] = arg(None, cli=False)
    tensor_parallel_size: int = arg(
        1, "split every layer over N processes (torch.distributed; default 1)", aliases=["-tp"]
    )
    pipeline_parallel_size: int = arg(
        1, "split the layers into N pipeline stages, one process each (default 1)", aliases=["-pp"]
    )
    data_parallel_size: int = arg(
        1, "N engine replicas behind a prefix-cache-aware router (serve; default 1)", aliases=["-dp"]
    )
    distributed_executor_backend: Optional[str] = arg(
        None,
        "where the ranks run: local processes (mp, default) or a Ray cluster (RAY_ADDRESS, else a local one)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    device: str = arg(
        "auto", "where the model runs (default auto: cuda when torch sees a GPU, else cpu)", choices=("auto", *DEVICES)
    )
    attention_backend: str = arg(
        "auto",
        "paged attention kernels (default auto: triton on cuda, torch + C++ on cpu)",
        choices=_attention_backend_choices,
    )
    gpu_memory_utilization: float = arg(0.9, "share of the GPU's memory for weights, activations and KV cache")
    enforce_eager: bool = arg(False, "GPU: run every step eagerly instead of replaying CUDA graphs")
    # CUDA graphs of decode steps only, or of mixed prefill + decode steps too (vLLM's name).
    cudagraph_mode: str = arg(
        "FULL",
        "GPU: CUDA graphs of decode steps only, or of mixed prefill + decode steps too at padded token "
        "counts (FULL, default); NONE as --enforce-eager (vLLM's names)",
        choices=CUDAGRAPH_MODES,
        type=str.upper,
    )
    # The parser's None lets --task (its older name) decide; cli.py resolves the two.
    runner: str = arg(
        "generate",
        "generate (sampling, default) or pooling: an embedding per prompt, served on /v1/embeddings (vLLM's flag)",
        choices=RUNNERS,
        cli_default=None,
    )
    enable_lora: bool = arg(False, "serve LoRA adapters (vLLM's flag)")
    max_loras: int = arg(1, "most distinct adapters in one step: the device slots")
    max_lora_rank: int = arg(16, "largest adapter rank")
    max_cpu_loras: Optional[int] = arg(None, "adapters kept in host memory, LRU (default: --max-loras)")
    # P/D disaggregation: vLLM's --kv-transfer-config (JSON text, a dict, or a KVTransferConfig).
    kv_transfer_config: Optional[object] = arg(
        None,
        'P/D disaggregation (vLLM\'s flag), JSON: {"kv_connector": "ZmqConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip", "kv_port", '
        '"kv_connector_extra_config": {"timeout_s", "use_shm"}}',
    )
    quantization: Optional[str] = arg(
        None,
        "CPU weight-only quantization: int8, int4 (groups), gguf (the default model's shipped Q4_1 file, "
        "or --model FILE.gguf, served as it is)",
        choices=_quantization_choices,
        aliases=["-q"],
    )
    quantization_group_size: Optional[int] = arg(
        None,
        "int4 / int8: input features per scale (and min: int4), 32 (default), 64 or 128; "
        "int8 -1: one scale per output channel",
    )
    # SpeculativeConfig's fields (a dict or its JSON).
    speculative_config: Optional[dict] = arg(
        None,
        'speculative decoding as JSON (vLLM\'s): {"method": "ngram" | "draft_model" | "mtp", '
        '"num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 8, '
        '"model": "self:N" | DIR, "length_policy": "fixed" | "adaptive"}',
        type=_speculative_config,
    )
    kv_cache_dtype: str = arg(
        "auto",
        "KV cache element: auto (the model's dtype); bfloat16 (a float32 model's K/V rounded to bfloat16, "
        "CPU only: half the bytes, as llama.cpp's default f16 cache); or int8 / fp8 with a float32 scale per "
        "token and KV head (fp8 = fp8_e4m3; vLLM's flag)",
        choices=KV_CACHE_DTYPES,
    )
    async_scheduling: bool = arg(
        False,
        "schedule and submit step N+1 while step N runs on the device, so that the host's work overlaps "
        "it (vLLM's flag; not with speculative decoding, beam search, structured outputs, pooling, P/D or "
        "tensor / pipeline parallelism)",
    )
    scheduling_policy: str = arg(
        "fcfs",
        "fcfs (arrival order, default) or priority: each request's priority (lower first, then "
        "arrival) orders the queue and picks who is preempted (vLLM's flag)",
        choices=SCHEDULING_POLICIES,
    )
    generation_config: str = arg(
        "auto",
        "sampling defaults: auto (the model's generation_config.json: temperature, top_p, top_k, "
        "min_p, repetition_penalty, unless a request sets them), vllm (none), or a folder holding a "
        "generation_config.json (vLLM's flag)",
    )
    limit_mm_per_prompt: Optional[dict] = arg(
        None,
        'vision-language models: the most images one prompt may carry, JSON: {"image": N} (vLLM\'s flag; default 999)',
        type=_limit_mm_per_prompt,
    )
    allowed_local_media_path: str = arg(
        "", "the folder whose files image_url parts may name as file:// URLs (vLLM's flag; default none)"
    )

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
        mc = model_config_from_dir(path, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed)
        mc.dtype = resolve_dtype(mc.dtype, mc.hf_config, dc.device)
        mc.runner = self.runner
        from pagedllm.engine.generation_defaults import load_sampling_defaults

        mc.sampling_defaults = load_sampling_defaults(self.generation_config, path)
        set_quantization(mc, self.quantization, self.quantization_group_size, dc.device)
        from pagedllm.multimodal.limits import check_allowed_local_media_path, parse_limit_mm_per_prompt

        mc.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        mc.allowed_local_media_path = check_allowed_local_media_path(self.allowed_local_media_path)
        prefix_caching = self.enable_prefix_caching
        if self.runner == "pooling":
            mc.pooler_config = PoolerConfig.from_dir(path)
            # A mean needs every prompt token's hidden state: a cached prefix would skip some.
            prefix_caching = prefix_caching and mc.pooler_config.pooling_type == "LAST"
        sc = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=mc.max_model_len,
            chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            async_scheduling=bool(self.async_scheduling),
            scheduling_policy=self.scheduling_policy,
        )
        image_tokens = bidirectional_image_tokens(mc.hf_config)
        if image_tokens:  # vLLM forces --disable-chunked-mm-input for such models
            sc.disable_chunked_mm_input = True
            if self.max_num_batched_tokens < image_tokens:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= {image_tokens}, "
                    "the tokens of one image: this model's image tokens attend to each other, "
                    "so an image is prefilled in one step"
                )
        cc = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            num_gpu_blocks=self.num_gpu_blocks,
            enable_prefix_caching=prefix_caching,
            swap_space=self.swap_space,
            num_cpu_blocks=self.num_cpu_blocks,
            cache_dtype=self.kv_cache_dtype,
        )
        pc = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        spec = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method in ("draft_model", "mtp"):  # drafts write K/V past the last token
            sc.num_lookahead_tokens = spec.num_speculative_tokens
        lc = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None
        sc.max_loras = lc.max_loras if lc is not None else 0  # distinct adapters in one step
        config = EngineConfig(mc, cc, sc, pc, dc, lc, speculative_config=spec)
        if self.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer.config import KVTransferConfig

            config.kv_transfer_config = KVTransferConfig.from_cli(self.kv_transfer_config)
            config.kv_transfer_config.resolve_port()
        config.validate()
        check_compatibility(config)
        return config

    def _device_config(self) -> DeviceConfig:
        """'auto' resolved and the backend's name checked against the attention backends' registry;
        other bad values are refused by EngineConfig.validate."""
        device = resolve_device(self.device)
        backend = self.attention_backend
        if backend not in _attention_backend_choices():
            raise ValueError(f"attention_backend must be one of {_attention_backend_choices()}, got {backend!r}")
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        if backend == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)") from None
        mode = str(self.cudagraph_mode).upper()
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        graphs = device == "cuda" and not self.enforce_eager and mode != "NONE"
        mixed = graphs and mode == "FULL"
        return DeviceConfig(
            device=device,
            attention_backend=backend,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=bool(self.enforce_eager),
            cuda_graph_sizes=cuda_graph_ladder(self.max_num_seqs) if graphs else [],
            mixed_graph_sizes=mixed_graph_ladder(self.max_num_batched_tokens) if mixed else [],
        )


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without one is a ValueError."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}); use device 'cpu' or 'auto'"
        )
    return device
