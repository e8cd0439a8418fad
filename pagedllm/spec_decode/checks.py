"""What a speculative config needs of the rest of the engine (EngineConfig.validate)."""
from __future__ import annotations


def check_speculative_config(config) -> None:
    spec = config.speculative_config
    spec.validate()
    if config.model_config.runner != "generate":
        raise ValueError("speculative_config needs runner 'generate' (a pooling runner samples nothing)")
    if config.parallel_config.world_size > 1:
        raise ValueError("speculative_config is not supported with tensor / pipeline parallelism yet")
    if spec.method == "mtp":
        hf = config.model_config.hf_config
        if not hf.get("num_nextn_predict_layers"):
            raise ValueError("speculative_config.method 'mtp' needs a DeepseekV3 checkpoint with "
                             "num_nextn_predict_layers > 0")
        if "DeepseekV3ForCausalLM" not in (hf.get("architectures") or []):
            raise ValueError(f"speculative_config.method 'mtp' needs a DeepseekV3ForCausalLM checkpoint "
                             f"(its next-n layers), got architectures {hf.get('architectures')}")
    if spec.method == "draft_model" and not spec.model.startswith("self:"):
        check_draft_dir(config, spec.model)
    if spec.method == "draft_model" and spec.model.startswith("self:"):
        n, layers = int(spec.model[5:]), config.model_config.num_layers
        if n >= layers:
            raise ValueError(f"speculative_config.model {spec.model!r}: N must be below the target's "
                             f"{layers} layers")


def check_draft_dir(config, path: str) -> None:
    """A draft model directory must share the target's vocabulary, reach its max_model_len and
    keep one KV cache group (its cache pages through the target's one block table)."""
    from pagedllm.models.hf_config import mixes_attention_windows
    target = config.model_config
    try:   # the target's ModelConfig class: no import of pagedllm.config (it imports this module)
        draft = type(target).from_dir(path).hf_config
    except ValueError as e:
        raise ValueError(f"speculative_config.model {path!r}: {e}") from None
    if draft.get("vocab_size") != target.vocab_size:
        raise ValueError(f"speculative_config.model {path!r}: the draft's vocab_size {draft.get('vocab_size')} "
                         f"differs from the target's {target.vocab_size} (a draft needs the same vocabulary)")
    if int(draft.get("max_position_embeddings", 2048)) < target.max_model_len:
        raise ValueError(f"speculative_config.model {path!r}: the draft's max_position_embeddings "
                         f"{draft.get('max_position_embeddings')} is below max_model_len {target.max_model_len}")
    if mixes_attention_windows(draft):
        raise ValueError(f"speculative_config.model {path!r}: a draft with sliding and full attention "
                         "layers (several KV cache groups) is not supported")
