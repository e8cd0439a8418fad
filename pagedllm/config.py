"""EngineConfig = ModelConfig + CacheConfig + SchedulerConfig + ParallelConfig.

Only plain values here: the core reads SchedulerConfig / CacheConfig without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.json_config import fields_from_json


POOLING_TYPES = ("LAST", "MEAN", "CLS")  # CLS: the first token (encoder models)


@dataclass
class PoolerConfig:
    """How `--runner pooling` turns a prompt's final hidden states (after the final norm) into one
    vector: its last token's or the mean over its tokens, L2-normalised or not."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def from_dir(cls, path: str, encoder: bool = False) -> "PoolerConfig":
        """A sentence-transformers directory's choice (modules.json + its Pooling module's
        config.json); else vLLM's default for a decoder LM: last token, normalised. CLS (the
        first token) only for an encoder (models/encoder_runner.py)."""
        modules_path = os.path.join(path, "modules.json")
        if not os.path.isfile(modules_path):
            return cls()
        with open(modules_path) as f:
            modules = json.load(f)
        types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
        pooling_type = "LAST"
        if "Pooling" in types:
            with open(os.path.join(path, types["Pooling"].get("path", ""), "config.json")) as f:
                modes = {k for k, v in json.load(f).items() if k.startswith("pooling_mode_") and v is True}
            known = {
                "pooling_mode_lasttoken": "LAST",
                "pooling_mode_mean_tokens": "MEAN",
                **({"pooling_mode_cls_token": "CLS"} if encoder else {}),
            }
            if len(modes) != 1 or not modes <= set(known):
                raise ValueError(
                    f"{modules_path}: pooling {sorted(modes)} is not supported (one of {', '.join(known)})"
                )
            pooling_type = known[modes.pop()]
        return cls(pooling_type=pooling_type, normalize="Normalize" in types)


@dataclass
class ModelConfig:
    """The model's plain values; built from a model directory by models/model_config_loader.py."""

    model: str  # directory of an HF-format model
    hf_config: dict = field(repr=False)
    dtype: str = "float32"
    max_model_len: int = 0
    seed: int = 0
    # "generate" (sampling) or "pooling" (an embedding per prompt, no sampling: /v1/embeddings).
    runner: str = "generate"
    pooler_config: Optional[PoolerConfig] = None  # with runner "pooling"
    quantization: Optional[str] = None  # CPU weights: models/layers/quantization/registry.py
    quantization_group_size: Optional[int] = None  # int4's / int8's group (-1: int8 per channel)
    # --generation-config: the sampling defaults a request's unset fields take (engine/generation_defaults.py).
    sampling_defaults: dict = field(default_factory=dict)
    # Vision-language models (multimodal/limits.py, multimodal/media.py): the most images in one
    # prompt (--limit-mm-per-prompt, per modality), and the folder file:// image URLs may read.
    limit_mm_per_prompt: dict = field(default_factory=dict)
    allowed_local_media_path: str = ""

    def validate(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")

    # Shapes read by the KV cache and the model.
    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.get("num_key_value_heads", self.num_heads)

    @property
    def hidden_size(self) -> int:
        return self.hf_config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]


@dataclass
class CacheConfig:
    block_size: int = 16
    # Bytes for the KV cache; None: derive from the model (see worker.cache_engine).
    kv_cache_memory: Optional[int] = None
    num_gpu_blocks: Optional[int] = None  # set explicitly (tests) or computed from memory
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of CPU blocks for swap preemption
    num_cpu_blocks: Optional[int] = None  # set explicitly (tests) or computed from swap_space
    cache_dtype: str = "auto"  # KV cache: auto (the model's), int8, fp8 (= fp8_e4m3), fp8_e5m2

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        check_kv_cache_dtype(self.cache_dtype)
        if not (isinstance(self.swap_space, (int, float)) and self.swap_space >= 0):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")


# Allowed values, defined once: the CLI's choices (engine/arg_utils.py) and validation read these.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype's values -> the cache element's torch dtype, by name (torch-free here;
# attention/kv_quant.py makes the dtype). None: the model's dtype; "fp8" is e4m3, as vLLM's;
# bfloat16: a float32 model's K/V rounded to bfloat16 on the CPU (half the bytes each decode reads).
KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": "bfloat16",
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
PREEMPTION_MODES = ("recompute", "swap")
DEVICES = ("cpu", "cuda")  # EngineArgs also takes "auto"
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
RUNNERS = ("generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")  # priority: lower first, then arrival (vLLM's)
MM_MODALITIES = ("image",)  # --limit-mm-per-prompt's keys
DEFAULT_MM_LIMIT = 999  # images per prompt when --limit-mm-per-prompt leaves it unset (vLLM's)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    max_loras: int = 0  # --enable-lora: at most this many distinct adapters in a step (0: no LoRA)
    # Speculative decoding with a draft model: KV slots a running request gets beyond its step's
    # tokens, where the draft writes the K/V of the tokens it proposes (vLLM's num_lookahead_tokens).
    num_lookahead_tokens: int = 0
    # vLLM's async scheduling: step N+1 is scheduled and submitted while step N runs on the device
    # (core/async_scheduler.py, worker/async_output.py).
    async_scheduling: bool = False
    # "fcfs" (arrival order) or "priority": waiting and running requests ordered by
    # (request priority, arrival); the lowest-priority running request is the one preempted.
    scheduling_policy: str = "fcfs"
    # vLLM's disable_chunked_mm_input, which it forces for models whose image tokens attend to
    # each other both ways (Gemma 3): a step never ends inside an image; its tokens wait for a
    # step with room for all of them.
    disable_chunked_mm_input: bool = False

    def validate(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclass
class ParallelConfig:
    """How the model is split over processes (see pagedllm/distributed, pagedllm/executor)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas behind one router
    distributed_executor_backend: Optional[str] = None  # "mp" (default when split) or "ray"

    @property
    def world_size(self) -> int:
        """Processes of one engine replica (data parallelism multiplies replicas, not this)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.distributed_executor_backend not in (None, *DISTRIBUTED_EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}"
            )


@dataclass
class LoRAConfig:
    """--enable-lora: adapter slots on the device, their rank, adapters kept in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # None: max_loras

    def validate(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}"
            )


@dataclass
class DeviceConfig:
    """Where the model runs and how (the knobs of the GPU path; the CPU ignores the others)."""

    device: str = "cpu"  # "cpu" or "cuda" (resolved from "auto" by EngineArgs)
    # "torch" (CPU) or "triton" (paged kernels, GPU): a name in attention/backends/registry.py,
    # checked by EngineArgs, which resolves "auto".
    attention_backend: str = "torch"
    gpu_memory_utilization: float = 0.9  # share of the device's memory the engine may use
    enforce_eager: bool = False  # True: no CUDA graphs at all
    # Decode batch sizes captured as CUDA graphs; a decode batch is padded to the next one.
    cuda_graph_sizes: list = field(default_factory=list)
    # cudagraph_mode FULL: token counts captured for mixed prefill + decode steps (padded up).
    mixed_graph_sizes: list = field(default_factory=list)

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


def check_kv_cache_dtype(name) -> str:
    """--kv-cache-dtype's value, or a ValueError naming the field."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return name


# vLLM's compilation_config.cudagraph_mode values this engine has (no piecewise graphs).
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")


def cuda_graph_ladder(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs rounded up to 8 (at most limit):
    padding a decode batch costs at most 7 wasted rows."""
    top = min(limit, -(-max_num_seqs // 8) * 8)
    return [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))


def mixed_graph_ladder(max_num_batched_tokens: int, limit: int = 2048) -> list[int]:
    """Token counts 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x them) up to the step's
    token budget (at most limit): padding wastes under a third of a step's rows. Steps above
    limit are long enough that their launches no longer dominate; they run eagerly."""
    top = min(limit, max_num_batched_tokens)
    sizes, p = [], 16
    while p < top:
        sizes += [s for s in (p, p * 3 // 2) if s < top]
        p *= 2
    return sizes + [top]


def resolve_dtype(dtype: str, hf_config: dict, device: str) -> str:
    """'auto': float32 on the CPU (this engine's fast path there), the config's torch_dtype on a
    GPU (bfloat16 where the config names none)."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    named = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return named if named in ("float32", "bfloat16", "float16") else "bfloat16"


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    lora_config: Optional[LoRAConfig] = None  # None: LoRA off
    # P/D disaggregation (distributed/kv_transfer/config.KVTransferConfig), or None.
    kv_transfer_config: Optional[object] = None
    speculative_config: Optional["SpeculativeConfig"] = None

    def validate(self) -> None:
        """Each config checks its own fields; the rules across features are engine/compat.py's."""
        for part in (
            self.model_config,
            self.cache_config,
            self.scheduler_config,
            self.parallel_config,
            self.device_config,
            self.lora_config,
            self.speculative_config,
        ):
            if part is not None:
                part.validate()


SPEC_METHODS = ("ngram", "draft_model", "mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` JSON / `speculative_config=`): a
    proposer drafts up to `num_speculative_tokens` tokens a step, the target verifies them in
    the same forward (spec_decode/, worker/rejection_sampler.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2  # n-gram: shortest suffix looked up in the tokens so far
    prompt_lookup_max: int = 8  # n-gram: longest
    model: Optional[str] = None  # draft_model: "self:N" (the target's first N layers) or an HF dir
    # Speculation length: "fixed" (always num_speculative_tokens, as vLLM) or "adaptive" (from
    # the measured acceptance and the batch size, up to num_speculative_tokens; 0 when it does not pay).
    length_policy: str = "fixed"

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        """From the JSON object (a str is parsed); ValueError naming the bad field."""
        d = fields_from_json(d, cls, "speculative_config")
        if "method" not in d and d.get("model") is not None:  # vLLM: a model given is a draft model
            d = {**d, "method": "draft_model"}
        if "prompt_lookup_min" not in d and isinstance(d.get("prompt_lookup_max"), int):
            d = {**d, "prompt_lookup_min": min(cls.prompt_lookup_min, d["prompt_lookup_max"])}
        config = cls(**d)
        config.validate()
        return config

    def validate(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not is_int(lo) or lo < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be an integer >= 1, got {lo!r}")
        if not is_int(hi) or hi < lo:
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min ({lo}), got {hi!r}"
            )
        if self.length_policy not in ("fixed", "adaptive"):
            raise ValueError(
                f"speculative_config.length_policy must be 'fixed' or 'adaptive', got {self.length_policy!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config.model is required with method 'draft_model' ('self:N' or an HF model directory)"
                )
            if self.model.startswith("self:"):
                n = self.model[5:]
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"speculative_config.model 'self:N' needs N >= 1 layers, got {self.model!r}")
            elif not os.path.isdir(self.model):
                raise ValueError(f"speculative_config.model {self.model!r} is not 'self:N' or a directory")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model is not used by method {self.method!r}; leave it out")
