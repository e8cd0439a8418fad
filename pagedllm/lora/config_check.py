"""What --enable-lora runs with, checked once at engine start (no torch here)."""
from __future__ import annotations


def validate_lora_config(config) -> None:
    """ValueError where the engine cannot serve adapters as configured; sets the scheduler's
    limit of distinct adapters per step."""
    lc, p, m = config.lora_config, config.parallel_config, config.model_config
    lc.validate()
    if p.world_size > 1:
        raise ValueError("enable_lora runs on one unsplit model: tensor_parallel_size and "
                         "pipeline_parallel_size must be 1")
    if m.runner != "generate":
        raise ValueError("enable_lora needs runner 'generate'")
    config.scheduler_config.max_loras = lc.max_loras
