"""What async scheduling cannot run with (core/async_scheduler.py): checked when the engine is
built (EngineConfig.validate) and when a request arrives (Processor). Apart from the
scheduler, so that config.py can call it without importing the scheduler (which imports config)."""
from __future__ import annotations

from pagedllm.sampling_params import ParamError, SamplingParams


def check_async_scheduling(config) -> None:
    """EngineConfig.validate: the features async scheduling cannot run with -> ValueError."""
    p, m = config.parallel_config, config.model_config
    refused = [("speculative_config", config.speculative_config is not None),
               ("kv_transfer_config (P/D disaggregation)", config.kv_transfer_config is not None),
               ("runner 'pooling'", m.runner != "generate"),
               ("tensor_parallel_size / pipeline_parallel_size > 1", p.world_size > 1)]
    for what, present in refused:
        if present:
            raise ValueError(f"async_scheduling is not supported with {what}; turn one of them off")


def check_async_request(params: SamplingParams, beam_width: int = 1) -> None:
    """Processor: a request async scheduling cannot serve -> ParamError naming the field."""
    if beam_width > 1 or params.external_tokens:
        raise ParamError("beam_width", "beam search is not supported with async_scheduling")
    if params.structured_outputs is not None:
        raise ParamError("structured_outputs", "structured_outputs is not supported with async_scheduling")
