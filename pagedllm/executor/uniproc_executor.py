"""UniProcExecutor: the whole model in this process, one Worker holding the ModelRunner.

A failed step leaves it usable (reset forgets the rows; engine/step_failures.py rolls back).

Async scheduling (core/async_scheduler.py): two steps in flight. On a GPU `submit` returns once
the step's kernels are launched (the runner's AsyncModelRunnerOutput); on the CPU the step runs
on one worker thread (torch releases the GIL in its kernels), so the host's scheduling and
output processing overlap it there too. Steps run in submission order either way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, eos_token_ids)
        self.driver_worker = Worker(config, self.eos_token_ids)
        self.driver_worker.init_device()
        self.driver_worker.load_model()
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._thread: Optional[ThreadPoolExecutor] = None
        if self.async_scheduling and config.device_config.device == "cpu":
            # OpenMP's thread count is per thread: the step thread takes this one's.
            self._thread = ThreadPoolExecutor(
                1,
                thread_name_prefix="pagedllm-step",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )

    def kv_bytes_per_block(self) -> int:
        return self.driver_worker.kv_bytes_per_block()

    def get_kv_cache_config(self) -> KVCacheConfig:
        return self.driver_worker.model_runner.kv_cache_config

    def determine_available_memory(self) -> int:
        return self.driver_worker.determine_available_memory()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.driver_worker.init_kv_cache(num_blocks, num_cpu_blocks)

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.async_scheduling else 1

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.submit(so))

    def submit(self, so: SchedulerOutput) -> Any:
        if self._thread is not None:
            return self._thread.submit(self.driver_worker.execute_model, so)
        return self.driver_worker.execute_model(so)

    def finish(self, handle: Any) -> ModelRunnerOutput:
        out = handle.result() if isinstance(handle, Future) else handle
        return out.get_output() if hasattr(out, "get_output") else out  # async: AsyncModelRunnerOutput

    def reset(self) -> None:
        self.driver_worker.reset()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.driver_worker.shutdown()
