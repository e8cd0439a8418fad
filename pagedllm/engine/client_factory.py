"""make_core_client: the EngineCoreClient for a config (its own module, so that neither
client imports the other, nor AsyncLLM the data-parallel one's internals)."""

from __future__ import annotations

from pagedllm.engine.core_client import CoreClient, EngineCoreClient
from pagedllm.engine.dp_client import DPCoreClient


def make_core_client(config, eos_ids, log_level: str = "INFO") -> EngineCoreClient:
    """One core process, or K data-parallel replicas behind the router."""
    if config.parallel_config.data_parallel_size > 1:
        return DPCoreClient(config, eos_ids, log_level)
    return CoreClient(config, eos_ids, log_level)
