"""DistributedExecutor: the model of one engine replica over world_size ranks.

To EngineCore it looks like a ModelRunner (eos_ids, kv_bytes_per_block, init_kv_cache,
execute_model). Each step it hands the SchedulerOutput (and the tokens sampled in the previous
step) to every other rank, runs rank 0's shard itself (the collectives keep the ranks in
lock-step), and returns rank 0's ModelRunnerOutput. The control messages go through a pipe
(mp) or a Ray actor call (ray); tensors only ever move through torch.distributed collectives.

Failure: a worker that dies makes the driver's next collective fail at once (or the liveness
check before the step catch it); the executor then raises ExecutorError naming the rank, its
pid and how it ended, kills the remaining workers and refuses any further step. Nothing waits
without a timeout.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """A rank of the split model failed: the engine cannot continue."""


class DistributedExecutor:
    backend_name = "?"

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.distributed.parallel_state import dist_timeout, init_parallel_context
        from pagedllm.executor.worker import ParallelModelRunner
        self.config = config
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.tp_size, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.failed: Optional[ExecutorError] = None
        self.is_shutdown = False
        # Tokens the driver sampled since the last message to the workers: they go with it.
        self.prev_sampled: dict[str, list[int]] = {}
        # Pipelining: steps are numbered as submitted; a request preempted by a later step
        # than the one being finished gets no token from it (it recomputes from scratch).
        self._seq = 0
        self._num_finished = 0
        self.max_in_flight = 0
        self._preempted_at: dict[str, int] = {}
        # Every rank can be busy at once (TP ranks always; pipeline stages with steps in
        # flight), so the cores are divided among them: more threads than cores makes
        # OpenMP's barriers spin against each other (measured: several times slower).
        self._saved_threads = torch.get_num_threads()
        env_threads = envs.PAGEDLLM_WORKER_THREADS
        self.num_threads = env_threads or max(1, self._saved_threads // self.world_size)
        self.host = self._driver_host()
        self.store = dist.TCPStore(self.host, 0, self.world_size, is_master=True,
                                   timeout=dist_timeout(), wait_for_workers=False)
        self.master_port = self.store.port
        self.parallel = None
        self.stats = None
        self._stats_box: list = []   # for a backend's finalizer (which must not hold self)
        try:
            self._start_workers()
            self._send_all("init_device", ())
            torch.set_num_threads(self.num_threads)
            hf = config.model_config.hf_config
            self.parallel = self._while_workers_live(
                lambda: init_parallel_context(hf, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                              0, self.host, self.master_port, self.host, store=self.store),
                envs.PAGEDLLM_WORKER_START_TIMEOUT_S, "joining the process groups")
            self.stats = self.parallel.stats
            self._stats_box.append(self.stats)
            self.driver = ParallelModelRunner(config, self.parallel)
            self.worker_kv_bytes = self._collect_all(envs.PAGEDLLM_WORKER_START_TIMEOUT_S, "loading the model")
        except BaseException as e:
            self.shutdown()
            if isinstance(e, ExecutorError):
                raise
            raise ExecutorError(f"the {self.backend_name} executor failed to start: {e}") from e
        logger.info("%s executor: %d ranks (tensor %d x pipeline %d), %d threads each, worker pids %s",
                    self.backend_name, self.world_size, pc.tensor_parallel_size,
                    pc.pipeline_parallel_size, self.num_threads, self.worker_pids())

    # ------------------------------------------------------------ to be provided by a backend
    def _driver_host(self) -> str:
        return "127.0.0.1"

    def _start_workers(self) -> None:
        raise NotImplementedError

    def _send_all(self, method: str, args: tuple, ranks: Optional[range] = None) -> None:
        """Call `method(*args)` on every worker (or those of `ranks`) without waiting."""
        raise NotImplementedError

    def _collect_all(self, timeout: float, what: str) -> list:
        """The results of the last _send_all (not for execute_model)."""
        raise NotImplementedError

    def _after_step(self, wait: bool) -> None:
        """Anything to reap after the driver's part of a step (ray: the calls' results; with
        steps in flight, only those already done)."""

    def _dead_worker(self, wait: float = 0.0) -> Optional[str]:
        """A description of a worker that died or reported a failure, else None; waits up to
        `wait` seconds for one to show (after a failed collective)."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError

    def worker_pids(self) -> list[int]:
        raise NotImplementedError

    # ------------------------------------------------------------ ModelRunner's face
    @property
    def eos_ids(self) -> set[int]:
        return self.driver.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.driver.eos_ids = set(ids)   # only the driver samples

    def kv_bytes_per_block(self) -> int:
        """Every rank gets the same number of blocks: the memory budget binds the largest shard."""
        return max([self.driver.kv_bytes_per_block(), *self.worker_kv_bytes])

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self._check()
        self._send_all("init_kv_cache", (num_blocks, num_cpu_blocks))
        self.driver.init_kv_cache(num_blocks, num_cpu_blocks)
        self._collect_all(envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S, "allocating the KV cache")

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._check()
        if self.pp_size > 1:
            return self.finish(self.submit(so))
        try:
            self._send_all("execute_model", (so, self._take_sampled()))
            out = self.driver.execute_model(so)
            self._after_step(wait=True)
        except Exception as e:
            raise self._failure(e)
        self._record(out)
        return out

    # Pipeline parallelism: EngineCore keeps up to pipeline_parallel_size steps in flight.
    def submit(self, so: SchedulerOutput):
        """Start a step on every rank (stage 0's part runs here); -> a handle for finish()."""
        self._check()
        try:
            self._send_all("execute_model", (so, self._take_sampled()))
            pending = self.driver.submit_step(so)
        except Exception as e:
            raise self._failure(e)
        seq = self._seq
        self._seq += 1
        self.max_in_flight = max(self.max_in_flight, self._seq - self._num_finished)
        for req_id in so.preempted_req_ids:
            self._preempted_at[req_id] = seq
        return seq, pending

    def finish(self, handle) -> ModelRunnerOutput:
        """Wait for the oldest step's last stage, sample on the driver; -> its output."""
        self._check()
        seq, pending = handle
        try:
            if self.tp_size > 1:
                self._send_all("finish_step", (), ranks=range(1, self.tp_size))
            out = self.driver.finish_step(pending)
            self._after_step(wait=False)
        except Exception as e:
            raise self._failure(e)
        self._num_finished += 1
        for row, req_id in enumerate(out.req_ids):
            if out.sampled_token_ids[row] and self._preempted_at.get(req_id, -1) > seq:
                out.sampled_token_ids[row] = []
        self._preempted_at = {r: s for r, s in self._preempted_at.items() if s > seq + 1}
        self._record(out)
        return out

    def _take_sampled(self) -> dict[str, list[int]]:
        sampled, self.prev_sampled = self.prev_sampled, {}
        return sampled

    def _record(self, out: ModelRunnerOutput) -> None:
        self.stats.steps += 1
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            if tokens:
                self.prev_sampled.setdefault(req_id, []).extend(tokens)

    def _failure(self, e: Exception) -> ExecutorError:
        if isinstance(e, ExecutorError):
            return self._fail(e)
        dead = self._dead_worker(wait=5.0)
        msg = (f"{dead}; the engine cannot continue" if dead else
               f"a step of the split model failed on the driver: {type(e).__name__}: {e}")
        err = self._fail(ExecutorError(msg))
        err.__cause__ = e
        return err

    def comm_stats(self) -> dict:
        """The driver's steps, and its time, calls and bytes in collectives so far."""
        return {**self.stats.as_dict(), "max_in_flight": self.max_in_flight}

    # ------------------------------------------------------------ health and the end
    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed
        if self.is_shutdown:
            raise ExecutorError("the executor has been shut down")
        dead = self._dead_worker()
        if dead:
            raise self._fail(ExecutorError(f"{dead}; the engine cannot continue"))

    def _fail(self, err: ExecutorError) -> ExecutorError:
        logger.error("%s", err)
        self.failed = err
        self.shutdown()
        return err

    def _while_workers_live(self, fn: Callable, timeout: float, what: str):
        """fn() in a thread, watching the workers: a dead one ends the wait at once."""
        box: dict = {}

        def run():
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
        t = threading.Thread(target=run, daemon=True, name="pagedllm-executor-init")
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive():
            t.join(0.2)
            dead = self._dead_worker()
            if dead:
                raise ExecutorError(f"{dead} while {what}")
            if time.monotonic() > deadline:
                raise ExecutorError(f"timed out after {timeout:.0f} s while {what}")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def shutdown(self) -> None:
        """Stop every worker (gracefully, then by force) and leave the process groups. Idempotent."""
        if self.is_shutdown:
            return
        self.is_shutdown = True
        if getattr(self, "stats", None) is not None and self.stats.steps:
            logger.info("%s executor, driver's communication: %s", self.backend_name, self.stats.summary())
        try:
            self._stop_workers()
        finally:
            if self.parallel is not None:
                self.parallel.close()
                self.parallel = None
            self.store = None
            torch.set_num_threads(self._saved_threads)
