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
        raise ValueError("speculative_config.method 'mtp' is not wired to a proposer yet (models/deepseek_mtp.py)")
    if spec.method == "draft_model" and spec.model.startswith("self:"):
        n, layers = int(spec.model[5:]), config.model_config.num_layers
        if n >= layers:
            raise ValueError(f"speculative_config.model {spec.model!r}: N must be below the target's "
                             f"{layers} layers")
