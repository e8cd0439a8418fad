"""UniProcExecutor: the whole model in this process, one Worker holding the ModelRunner.

A failed step leaves it usable (reset forgets the rows; engine/step_failures.py rolls back)."""
from __future__ import annotations

from typing import Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, eos_token_ids)
        self.driver_worker = Worker(config, self.eos_token_ids)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def kv_bytes_per_block(self) -> int:
        return self.driver_worker.kv_bytes_per_block()

    def determine_available_memory(self) -> int:
        return self.driver_worker.determine_available_memory()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.driver_worker.init_kv_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(so)

    def reset(self) -> None:
        self.driver_worker.reset()

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
