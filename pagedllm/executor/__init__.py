"""Executors: run one engine replica's model over several ranks (tensor / pipeline
parallelism). The driver (rank 0) lives in the EngineCore's process next to the scheduler;
the other ranks are local processes (`mp`, the default) or Ray actors (`ray`)."""
from __future__ import annotations

from pagedllm.executor.base import DistributedExecutor, ExecutorError


def make_executor(config) -> DistributedExecutor:
    backend = config.parallel_config.distributed_executor_backend or "mp"
    if backend == "mp":
        from pagedllm.executor.mp_executor import MultiprocExecutor
        return MultiprocExecutor(config)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor
        return RayExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")


__all__ = ["DistributedExecutor", "ExecutorError", "make_executor"]
