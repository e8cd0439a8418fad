"""EngineCore: the scheduler and the model executor, one step at a time.

It owns the KV cache; it knows nothing of text. The server runs it in its own process.
It always drives an Executor (pagedllm/executor: one process, or the ranks of a split model);
an executor that declares max_concurrent_batches > 1 (pipeline stages) gets a batch queue.
A step that raises is rolled back and only the request that caused it fails
(step_failures.py: RequestFailedError); the engine goes on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable, Optional

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorRole
from pagedllm.distributed.kv_transfer.factory import create_connector
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.engine.step_failures import StepFailures
from pagedllm.executor.abstract import Executor
from pagedllm.profiler import PROFILER
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


class EngineCore:
    batch_queue = None  # pipelined executors: steps in flight (see _init_cache)

    def __init__(
        self, config: EngineConfig, eos_ids: Iterable[int], executor_class: Optional[type[Executor]] = None
    ) -> None:
        """executor_class: None picks it from the config (Executor.get_class)."""
        self.config = config
        self.eos_ids = set(eos_ids)
        executor_class = executor_class or Executor.get_class(config)
        self.model_executor = executor_class(config, eos_token_ids=self.eos_ids)
        try:
            self._init_cache(config)
        except BaseException:
            self.shutdown()
            raise

    def _init_cache(self, config: EngineConfig) -> None:
        executor = self.model_executor
        # The layout the layers declared (the worker computed it; core/kv_cache_utils.py): the
        # KV cache manager keeps it, and the frontend's admission check reads it.
        self.kv_cache_config = executor.get_kv_cache_config()
        self.num_blocks = self._num_blocks()
        cc = config.cache_config
        self.num_cpu_blocks = 0
        if config.scheduler_config.preemption_mode == "swap":
            self.num_cpu_blocks = (
                cc.num_cpu_blocks
                if cc.num_cpu_blocks is not None
                else int(cc.swap_space * 2**30) // executor.kv_bytes_per_block()
            )
        executor.init_kv_cache(self.num_blocks, self.num_cpu_blocks)
        kv = KVCacheManager(
            self.num_blocks,
            cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks,
            kv_cache_config=self.kv_cache_config,
        )
        scheduler_class = Scheduler
        if config.scheduler_config.async_scheduling:  # output placeholders (core/async_scheduler.py)
            from pagedllm.core.async_scheduler import AsyncScheduler as scheduler_class
        self.scheduler = scheduler_class(
            config.scheduler_config,
            kv,
            connector=create_connector(config.kv_transfer_config, KVConnectorRole.SCHEDULER, cc.block_size),
        )
        self.structured_output_manager = StructuredOutputManager(
            config.model_config.model, config.model_config.vocab_size, self.eos_ids
        )
        self.failures = StepFailures(self.scheduler, executor)
        # Pipeline parallelism: up to max_concurrent_batches steps in flight, so that no stage
        # waits for the others (recompute preemption only: a swapped-out request must not
        # have a step in flight). Async scheduling: two, the next step submitted while one runs
        # (steps run in order on one device, so a swap copy follows the step before it).
        self.batch_queue = None
        self.batch_queue_size = executor.max_concurrent_batches
        if self.batch_queue_size > 1 and (
            config.scheduler_config.preemption_mode == "recompute" or config.scheduler_config.async_scheduling
        ):
            self.batch_queue = deque()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            self.num_blocks,
            cc.block_size,
            (self.num_blocks - 1) * cc.block_size,
            self.num_blocks * executor.kv_bytes_per_block() / 2**30,
        )

    def _num_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks
        on_gpu = self.config.device_config.device == "cuda"
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif on_gpu:  # what a profiled forward leaves of gpu_memory_utilization (worker/memory.py)
            budget = self.model_executor.determine_available_memory()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        by_memory = budget // self.model_executor.kv_bytes_per_block()
        if by_memory < 2:
            raise ValueError(
                f"kv_cache_memory ({budget} bytes) holds fewer than 2 blocks of "
                f"{self.model_executor.kv_bytes_per_block()} bytes"
            )
        if on_gpu:  # all of it: blocks beyond the running requests' keep the prefix cache
            return int(by_memory)
        # On the CPU: enough for every sequence at full length (a sliding group's: its window),
        # capped by the memory budget.
        useful = (
            sc.max_num_seqs
            * self.kv_cache_config.max_num_blocks(sc.max_model_len, cc.block_size, sc.max_num_batched_tokens)
            + 1
        )
        return int(min(useful, by_memory))

    def shutdown(self) -> None:
        """Stop the executor (the worker processes of a split model). Idempotent."""
        self.model_executor.shutdown()
        if hasattr(self, "structured_output_manager"):
            self.structured_output_manager.shutdown()

    def add_request(self, request: Request) -> None:
        self.structured_output_manager.grammar_init(request)  # compiles off the loop
        self.scheduler.add_request(request)

    def _schedule(self):
        """The step's SchedulerOutput with the token bitmask of its constrained rows."""
        PROFILER.begin_step()
        so = self.failures.schedule()
        self.structured_output_manager.grammar_bitmask(self.scheduler.requests, so)
        PROFILER.mark("schedule")
        return so

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def abort_requests(self, req_ids) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        sched = self.scheduler
        return (
            sched.has_unfinished_requests()
            or sched.has_kv_transfers()
            or bool(sched.kv_load_failures)
            or bool(self.batch_queue)
        )

    def _raise_kv_load_failures(self) -> None:
        """Requests whose remote KV could not be loaded (distributed/kv_transfer) were ended by
        the last update: their clients get the error."""
        failures, self.scheduler.kv_load_failures = self.scheduler.kv_load_failures, []
        if failures:
            raise RequestFailedError([r for r, _ in failures], "; ".join(f"{r}: {why}" for r, why in failures))

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        self._raise_kv_load_failures()
        if not self.has_unfinished_requests():
            return []
        so = self._schedule()
        try:
            ro = self.model_executor.execute_model(so)
        except Exception as e:
            self.failures.step_failed(so, e)  # raises RequestFailedError once a culprit is known
            return []
        self.failures.step_done(so)
        outputs = self.scheduler.update_from_output(so, ro)
        PROFILER.mark("scheduler_update")
        if so.total_num_scheduled_tokens == 0 and self.scheduler.connector is not None:
            time.sleep(0.001)  # only KV transfers in flight: do not spin a core while they run
        return outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Schedule and submit a step while fewer than batch_queue_size are in flight; else
        (or when nothing new can run) finish the oldest one and apply its output. The scheduler
        counts scheduled tokens as computed, so a request with a step in flight is not
        scheduled again until its output is in (a prefill's next chunk may be), unless async
        scheduling gave it an output placeholder (core/async_scheduler.py)."""
        if self.scheduler.has_unfinished_requests() and len(self.batch_queue) < self.batch_queue_size:
            so = self._schedule()
            try:
                handle = self.model_executor.submit(so)
            except Exception as e:
                return self._batch_failed(so, e)
            if so.total_num_scheduled_tokens > 0:
                self.batch_queue.append((so, handle))
                if len(self.batch_queue) < self.batch_queue_size:
                    return []
            else:  # only bookkeeping (finished / preempted ids): done at once
                outputs = self._finish(so, handle)
                if outputs or not self.batch_queue:
                    return outputs
        if not self.batch_queue:
            return []
        return self._finish(*self.batch_queue.popleft())

    def _finish(self, so, handle) -> list[EngineCoreOutput]:
        try:
            ro = self.model_executor.finish(handle)
        except Exception as e:
            return self._batch_failed(so, e)
        PROFILER.mark("runner_update")  # async scheduling: the wait for the step's tokens
        self.failures.step_done(so)
        outputs = self.scheduler.update_from_output(so, ro)
        PROFILER.mark("scheduler_update")
        return outputs

    def _batch_failed(self, so, e: Exception) -> list[EngineCoreOutput]:
        """A step in the batch queue failed: the steps behind it were built on it, so they are
        waited for and dropped, then the failure is handled as step() does (roll back, isolate)."""
        while self.batch_queue:
            dropped, handle = self.batch_queue.popleft()
            so.finished_req_ids |= dropped.finished_req_ids  # the runner forgets every row
            so.preempted_req_ids |= dropped.preempted_req_ids  # a swap-out that may not have run
            try:
                self.model_executor.finish(handle)
            except Exception:  # noqa: BLE001 -- dropped with the step that failed
                pass
        self.failures.step_failed(so, e)  # raises RequestFailedError once a culprit is known
        return []
