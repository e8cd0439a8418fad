"""Which features combine: every rule that reads more than one config (or a config and the
model) lives here, checked once when EngineArgs builds the EngineConfig; each config class
checks its own fields (its validate(), config.py).

`CONFLICTS` is the table of pairs that do not run together; `check_speculative_model` what a
speculative method needs of the checkpoint; `check_request` what the features on refuse of
one request. A feature that cannot run with another is one `Conflict` row.
Torch-free (the processor imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pagedllm.sampling_params import ParamError, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


@dataclass(frozen=True)
class Feature:
    """A feature as the messages name it, and whether a config has it on."""

    name: str
    on: Callable[["EngineConfig"], bool]


def _spec_method(config: "EngineConfig"):
    return config.speculative_config.method if config.speculative_config is not None else None


def _several_kv_groups(config: "EngineConfig") -> bool:
    from pagedllm.models.hf_config import mixes_attention_windows

    # With pipeline stages the transfer / draft paths are refused as a split model already.
    return config.parallel_config.pipeline_parallel_size == 1 and mixes_attention_windows(config.model_config.hf_config)


SPECULATIVE = Feature("speculative_config", lambda c: c.speculative_config is not None)
DRAFT_MODEL = Feature("speculative_config 'draft_model'", lambda c: _spec_method(c) == "draft_model")
KV_TRANSFER = Feature("kv_transfer_config", lambda c: c.kv_transfer_config is not None)
LORA = Feature("enable_lora", lambda c: c.lora_config is not None)
ASYNC = Feature("async_scheduling", lambda c: c.scheduler_config.async_scheduling)
POOLING = Feature("runner 'pooling'", lambda c: c.model_config.runner != "generate")
SPLIT = Feature("tensor / pipeline parallelism", lambda c: c.parallel_config.world_size > 1)
REPLICAS = Feature("data_parallel_size > 1", lambda c: c.parallel_config.data_parallel_size > 1)
CUDA = Feature("device 'cuda'", lambda c: c.device_config.device == "cuda")
CPU_BACKEND = Feature("a CPU attention backend", lambda c: c.device_config.attention_backend != "triton")
KV_GROUPS = Feature("several KV cache groups", _several_kv_groups)


def _recurrent(config: "EngineConfig") -> bool:
    from pagedllm.models.hf_config import has_recurrent_layers

    return has_recurrent_layers(config.model_config.hf_config)


RECURRENT = Feature("a model with recurrent layers", _recurrent)


@dataclass(frozen=True)
class Conflict:
    """`feature` does not run with `other`: the ValueError's message when both are on."""

    feature: Feature
    other: Feature
    message: str


_POOLING_ONE_REPLICA = (
    "runner 'pooling' runs one unsplit replica: tensor_parallel_size, "
    "pipeline_parallel_size and data_parallel_size must be 1"
)
_KV_TRANSFER_ONE_REPLICA = (
    "kv_transfer_config needs one unsplit generating replica: tensor_parallel_size, "
    "pipeline_parallel_size and data_parallel_size 1, runner 'generate'"
)
# Both move or reuse one block table's K/V; a hybrid model (Gemma 3) has one per group.
_ONE_BLOCK_TABLE = (
    "is not supported for a model with several KV cache groups (sliding and full attention layers, e.g. Gemma 3) yet"
)
_LORA_UNSPLIT = "enable_lora runs on one unsplit model: tensor_parallel_size and pipeline_parallel_size must be 1"


def _async_refuses(what: str) -> str:
    return f"async_scheduling is not supported with {what}; turn one of them off"


# Checked in this order; the first pair with both features on is the error.
CONFLICTS: tuple[Conflict, ...] = (
    # A rejected draft would have to roll the state back; the recurrent layers are not split.
    # (Prefix caching and async scheduling run with them: states are cached as snapshots at
    # block boundaries, core/state_kv_cache_manager.py.)
    Conflict(
        RECURRENT,
        SPECULATIVE,
        "speculative_config is not supported for a model with recurrent layers "
        "(Mamba2, LFM2): their state cannot be rolled back to the last accepted token",
    ),
    Conflict(
        RECURRENT,
        SPLIT,
        "tensor_parallel_size and pipeline_parallel_size must be 1 for a model with "
        "recurrent layers (Mamba2, LFM2): their layers are not split",
    ),
    Conflict(
        RECURRENT, KV_TRANSFER, "kv_transfer_config is not supported for a model with recurrent layers (Mamba2, LFM2)"
    ),
    Conflict(SPECULATIVE, POOLING, "speculative_config needs runner 'generate' (a pooling runner samples nothing)"),
    Conflict(SPECULATIVE, SPLIT, "speculative_config is not supported with tensor / pipeline parallelism yet"),
    Conflict(POOLING, SPLIT, _POOLING_ONE_REPLICA),
    Conflict(POOLING, REPLICAS, _POOLING_ONE_REPLICA),
    Conflict(KV_TRANSFER, SPLIT, _KV_TRANSFER_ONE_REPLICA),
    Conflict(KV_TRANSFER, REPLICAS, _KV_TRANSFER_ONE_REPLICA),
    Conflict(KV_TRANSFER, POOLING, _KV_TRANSFER_ONE_REPLICA),
    Conflict(KV_TRANSFER, KV_GROUPS, f"kv_transfer_config {_ONE_BLOCK_TABLE}"),
    Conflict(DRAFT_MODEL, KV_GROUPS, f"speculative_config 'draft_model' {_ONE_BLOCK_TABLE}"),
    Conflict(CUDA, CPU_BACKEND, "device 'cuda' needs attention_backend 'triton' (the torch backend is the CPU's)"),
    Conflict(
        CUDA,
        SPLIT,
        "tensor / pipeline parallelism runs on the CPU only for now; "
        "use device 'cpu' or tensor_parallel_size = pipeline_parallel_size = 1",
    ),
    Conflict(LORA, SPLIT, _LORA_UNSPLIT),
    Conflict(LORA, POOLING, "enable_lora needs runner 'generate'"),
    Conflict(ASYNC, SPECULATIVE, _async_refuses("speculative_config")),
    Conflict(ASYNC, KV_TRANSFER, _async_refuses("kv_transfer_config (P/D disaggregation)")),
    Conflict(ASYNC, POOLING, _async_refuses("runner 'pooling'")),
    Conflict(ASYNC, SPLIT, _async_refuses("tensor_parallel_size / pipeline_parallel_size > 1")),
)


def check_compatibility(config: "EngineConfig") -> None:
    """ValueError for the first pair of features that do not combine, a split the model cannot
    take (a GGUF file's: row-parallel inputs in whole blocks), or a speculative method the model
    cannot carry; run after EngineConfig.validate."""
    for rule in CONFLICTS:
        if rule.feature.on(config) and rule.other.on(config):
            raise ValueError(rule.message)
    p = config.parallel_config
    if p.world_size > 1:
        from pagedllm.distributed.sharding import validate_parallel_sizes

        validate_parallel_sizes(config.model_config.hf_config, p.tensor_parallel_size, p.pipeline_parallel_size)
        if p.tensor_parallel_size > 1 and config.model_config.quantization == "gguf":
            from pagedllm.models.gguf.tp_split import check_tp_split

            check_tp_split(config.model_config.model, config.model_config.hf_config, p.tensor_parallel_size)
    if config.speculative_config is not None:
        check_speculative_model(config)


def check_speculative_model(config: "EngineConfig") -> None:
    """What the speculative method needs of the target checkpoint (and of a draft directory)."""
    spec, hf = config.speculative_config, config.model_config.hf_config
    if spec.method == "mtp":
        if not hf.get("num_nextn_predict_layers"):
            raise ValueError(
                "speculative_config.method 'mtp' needs a DeepseekV3 checkpoint with num_nextn_predict_layers > 0"
            )
        if "DeepseekV3ForCausalLM" not in (hf.get("architectures") or []):
            raise ValueError(
                f"speculative_config.method 'mtp' needs a DeepseekV3ForCausalLM checkpoint "
                f"(its next-n layers), got architectures {hf.get('architectures')}"
            )
    if spec.method == "draft_model" and spec.model.startswith("self:"):
        n, layers = int(spec.model[5:]), config.model_config.num_layers
        if n >= layers:
            raise ValueError(f"speculative_config.model {spec.model!r}: N must be below the target's {layers} layers")
    elif spec.method == "draft_model":
        check_draft_dir(config, spec.model)


def check_draft_dir(config: "EngineConfig", path: str) -> None:
    """A draft model directory must share the target's vocabulary, reach its max_model_len and
    keep one KV cache group (its cache pages through the target's one block table)."""
    from pagedllm.models.hf_config import mixes_attention_windows
    from pagedllm.models.model_config_loader import model_config_from_dir

    target = config.model_config
    try:
        draft = model_config_from_dir(path).hf_config
    except ValueError as e:
        raise ValueError(f"speculative_config.model {path!r}: {e}") from None
    if draft.get("vocab_size") != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {path!r}: the draft's vocab_size {draft.get('vocab_size')} "
            f"differs from the target's {target.vocab_size} (a draft needs the same vocabulary)"
        )
    if int(draft.get("max_position_embeddings", 2048)) < target.max_model_len:
        raise ValueError(
            f"speculative_config.model {path!r}: the draft's max_position_embeddings "
            f"{draft.get('max_position_embeddings')} is below max_model_len {target.max_model_len}"
        )
    if mixes_attention_windows(draft):
        raise ValueError(
            f"speculative_config.model {path!r}: a draft with sliding and full attention "
            "layers (several KV cache groups) is not supported"
        )


def check_request(config: "EngineConfig", params: SamplingParams, beam_width: int = 1, lora_request=None) -> None:
    """What this engine's features refuse of one request (the processor calls it): a ParamError
    or ValueError naming the field."""
    if config.scheduler_config.async_scheduling:  # the next step needs the host's token
        if beam_width > 1 or params.external_tokens:
            raise ParamError("beam_width", "beam search is not supported with async_scheduling")
        if params.structured_outputs is not None:
            raise ParamError("structured_outputs", "structured_outputs is not supported with async_scheduling")
    if lora_request is not None and beam_width > 1:
        raise ValueError("lora_request is not supported with beam search")
    if params.prompt_logprobs is not None and SPLIT.on(config):
        raise ParamError(
            "prompt_logprobs", "prompt_logprobs is not supported with tensor or pipeline parallelism yet; leave it None"
        )
