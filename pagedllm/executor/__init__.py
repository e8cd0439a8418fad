"""Executors: how EngineCore runs one engine replica's model (executor/abstract.py). One process
(`uni`), or several ranks for tensor / pipeline parallelism: the driver (rank 0) lives in the
EngineCore's process next to the scheduler; the other ranks are local processes (`mp`, the
default) or Ray actors (`ray`)."""

from __future__ import annotations

from pagedllm.executor.abstract import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError"]
