"""Executor: how EngineCore runs the model of one engine replica, over one process or many.

EngineCore always drives an Executor (vLLM v1's executor/abstract.py): it sizes and allocates
the KV cache through it, hands it each step's SchedulerOutput and gets a ModelRunnerOutput
back. Whether steps can overlap is something the executor declares
(`max_concurrent_batches` > 1: pipeline stages; EngineCore then keeps a batch queue and uses
`submit` / `finish`), not something the core probes.

    uni  (uniproc_executor.py)          one process: one Worker holding the ModelRunner
    mp   (multiproc_executor.py)        rank 0 here, the other ranks in local processes
    ray  (ray_distributed_executor.py)  rank 0 here, the other ranks as Ray actors
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A rank of the split model failed: the engine cannot continue."""


# backend -> (module, class), imported when chosen (as models/registry.py does): a one-process
# engine never imports the transport of the others (Ray, sockets).
_BACKENDS = {
    "uni": ("pagedllm.executor.uniproc_executor", "UniProcExecutor"),
    "mp": ("pagedllm.executor.multiproc_executor", "MultiprocExecutor"),
    "ray": ("pagedllm.executor.ray_distributed_executor", "RayDistributedExecutor"),
}


class Executor:
    """The model of one engine replica, as EngineCore sees it."""

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        """Start the worker(s) and load the model. eos_token_ids: the ids that end a request
        (the sampler keeps them out until min_tokens)."""
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        """uni for one process; else ParallelConfig.distributed_executor_backend (mp by default)."""
        pc = config.parallel_config
        backend = "uni" if pc.world_size == 1 else (pc.distributed_executor_backend or "mp")
        if backend not in _BACKENDS:
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
        module, name = _BACKENDS[backend]
        return getattr(importlib.import_module(module), name)

    # ------------------------------------------------------------ the KV cache
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on a rank (the largest shard's: every rank gets as many)."""
        raise NotImplementedError

    def get_kv_cache_config(self) -> KVCacheConfig:
        """The KV cache layout the ranks' layers declare, as the scheduler keeps it."""
        raise NotImplementedError

    def determine_available_memory(self) -> int:
        """GPU: bytes left for the KV cache after a profiled forward (worker/memory.py)."""
        raise NotImplementedError

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ steps
    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once: 1, or the pipeline's stages."""
        return 1

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def submit(self, so: SchedulerOutput) -> Any:
        """Start a step; -> a handle for finish(). With one batch at a time the step runs here."""
        return self.execute_model(so)

    def finish(self, handle: Any) -> ModelRunnerOutput:
        """Wait for the oldest submitted step; -> its output."""
        return handle

    def reset(self) -> None:
        """Forget every request's rows after a failed step (the engine rolls back and sends
        them again). Only where a failed step leaves the executor usable."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back a failed step")

    # ------------------------------------------------------------ health and the end
    def check_health(self) -> None:
        """Raise ExecutorError if a rank is gone."""

    def shutdown(self) -> None:
        """Stop the workers. Idempotent."""
