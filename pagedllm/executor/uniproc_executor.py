"""UniProcExecutor: the whole model in this process, one Worker holding the ModelRunner.

A failed step leaves it usable (reset forgets the rows; engine/step_failures.py rolls back).

Async scheduling (core/async_scheduler.py): two steps in flight. On a GPU `submit` returns once
the step's kernels are launched (the runner's AsyncModelRunnerOutput), so the host's scheduling
and output processing overlap the device. On the CPU `submit` runs the step on the engine's
thread, as vLLM does there (it turns the flag off on the CPU): the step after is still
scheduled before this one's output is applied, with the same placeholders, but nothing
overlaps. A step thread paid twice: its OpenMP threads shared the two cores with the engine's
thread, and glibc gave it an arena of its own, whose blocks above 64 MiB (a 2,048-token
prefill's gate_up output) are fresh mappings, page-faulted on every write, whatever
worker/cpu_malloc.py sets (a 2,048-token prefill 1.2-1.55x slower).
"""

from __future__ import annotations

from typing import Any, Iterable

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
        return self.driver_worker.execute_model(so)

    def finish(self, handle: Any) -> ModelRunnerOutput:
        return handle.get_output() if hasattr(handle, "get_output") else handle  # async: AsyncModelRunnerOutput

    def reset(self) -> None:
        self.driver_worker.reset()

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
