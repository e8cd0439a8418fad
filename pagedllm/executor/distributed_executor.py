"""DistributedExecutor: the model of one engine replica over world_size ranks (the base of the
mp and ray executors).

Rank 0 (the driver worker) runs in this process beside the scheduler. Each step the executor
hands the SchedulerOutput (and the tokens the driver sampled since the last message, which the
driver's runner keeps) to every other rank, runs rank 0's shard itself (the collectives keep
the ranks in lock-step), and returns rank 0's ModelRunnerOutput. The control messages go
through a socket (mp) or a Ray actor call (ray); tensors only ever move through
torch.distributed collectives. With pipeline stages it declares max_concurrent_batches > 1 and
EngineCore keeps several steps in flight (submit / finish).

Failure: a worker that dies makes the driver's next collective fail at once (or the liveness
check before the step catch it); the executor then raises ExecutorError naming the rank, its
pid and how it ended, kills the remaining workers and refuses any further step. Nothing waits
without a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import KVCacheConfig, merge_stage_configs
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorError
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)


# Split engines alive in this process, and the thread count before the first of them: engines
# whose lifetimes overlap (a notebook, a test suite) share one saved value, given back when the
# last one goes. OpenMP's count is per thread: it comes back in the thread that releases (the
# caller's, unless a garbage collection runs elsewhere).
_split_engines = {"alive": 0, "threads": 0}


def _take_threads() -> int:
    if _split_engines["alive"] == 0:
        _split_engines["threads"] = torch.get_num_threads()
    _split_engines["alive"] += 1
    return _split_engines["threads"]


def _give_back_threads() -> None:
    _split_engines["alive"] -= 1
    if _split_engines["alive"] == 0:
        torch.set_num_threads(_split_engines["threads"])


class DistributedExecutor(Executor):
    backend_name = "?"

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()) -> None:
        from pagedllm.distributed.parallel_state import dist_timeout

        super().__init__(config, eos_token_ids)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.tp_size, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.failed: Optional[ExecutorError] = None
        self.is_shutdown = False
        self._in_flight = 0  # steps submitted and not finished
        self.max_in_flight = 0
        # Every rank can be busy at once (TP ranks always; pipeline stages with steps in
        # flight), so the cores are divided among them: more threads than cores makes
        # OpenMP's barriers spin against each other (measured: several times slower).
        self._saved_threads = _take_threads()
        # The caller's thread count comes back at shutdown, and also when the engine is dropped
        # without it (garbage collection), so a split engine does not leave the rest of the
        # process on 1 / world_size of the cores.
        self._restore_threads = weakref.finalize(self, _give_back_threads)
        env_threads = envs.PAGEDLLM_WORKER_THREADS
        self.num_threads = env_threads or max(1, self._saved_threads // self.world_size)
        self.host = self._driver_host()
        self.store = dist.TCPStore(
            self.host, 0, self.world_size, is_master=True, timeout=dist_timeout(), wait_for_workers=False
        )
        self.master_port = self.store.port
        self.driver_worker = Worker(
            config, self.eos_token_ids, rank=0, master_addr=self.host, master_port=self.master_port, host=self.host
        )
        self.stats = None
        self._stats_box: list = []  # for a backend's finalizer (which must not hold self)
        try:
            self._start_workers()
            self._send_all("init_device", ())
            torch.set_num_threads(self.num_threads)  # here: OpenMP's setting is per thread
            self._while_workers_live(
                lambda: self.driver_worker.init_device(store=self.store),
                envs.PAGEDLLM_WORKER_START_TIMEOUT_S,
                "joining the process groups",
            )
            self._collect_all(envs.PAGEDLLM_WORKER_START_TIMEOUT_S, "joining the process groups")
            self.stats = self.driver_worker.parallel.stats
            self._stats_box.append(self.stats)
            # Every rank gets the same number of blocks: the memory budget binds the largest shard.
            loaded = self.collective_rpc(
                "load_model", timeout=envs.PAGEDLLM_WORKER_START_TIMEOUT_S, what="loading the model"
            )
            self._kv_bytes_per_block = max(nbytes for nbytes, _ in loaded)
            self._kv_cache_config = merge_stage_configs([layout for _, layout in loaded])
        except BaseException as e:
            self.shutdown()
            if isinstance(e, ExecutorError):
                raise
            raise ExecutorError(f"the {self.backend_name} executor failed to start: {e}") from e
        logger.info(
            "%s executor: %d ranks (tensor %d x pipeline %d), %d threads each, worker pids %s",
            self.backend_name,
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            self.num_threads,
            self.worker_pids(),
        )

    # ------------------------------------------------------------ to be provided by a backend
    def _driver_host(self) -> str:
        return "127.0.0.1"

    def _start_workers(self) -> None:
        raise NotImplementedError

    def _send_all(self, method: str, args: tuple, ranks: Optional[range] = None) -> None:
        """Call `method(*args)` on every worker (or those of `ranks`) without waiting."""
        raise NotImplementedError

    def _collect_all(self, timeout: float, what: str) -> list:
        """The results of the last _send_all (not for the step calls: worker_main.STEP_CALLS)."""
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

    # ------------------------------------------------------------ the Executor interface
    def collective_rpc(self, method: str, args: tuple = (), timeout: float = 0.0, what: str = "") -> list:
        """`method(*args)` on every rank (the driver's here, after the others were sent theirs)
        -> the results, rank 0's first (not for the step calls)."""
        self._check()
        self._send_all(method, args)
        mine = getattr(self.driver_worker, method)(*args)
        return [mine, *self._collect_all(timeout or envs.PAGEDLLM_WORKER_CALL_TIMEOUT_S, what or method)]

    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def get_kv_cache_config(self) -> KVCacheConfig:
        return self._kv_cache_config

    def determine_available_memory(self) -> int:
        return min(self.collective_rpc("determine_available_memory", what="profiling the memory"))

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.collective_rpc("init_kv_cache", (num_blocks, num_cpu_blocks), what="allocating the KV cache")

    @property
    def max_concurrent_batches(self) -> int:
        # PAGEDLLM_PP_BATCH_QUEUE=0: one step at a time, to compare.
        return self.pp_size if self.pp_size > 1 and envs.PAGEDLLM_PP_BATCH_QUEUE else 1

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.pp_size > 1:
            return self.finish(self.submit(so))
        self._check()
        try:
            self._send_all("execute_model_worker", (so, self.driver_worker.take_sampled()))
            out = self.driver_worker.execute_model(so)
            self._after_step(wait=True)
        except Exception as e:
            raise self._failure(e)
        self.stats.steps += 1
        return out

    # Pipeline parallelism: EngineCore keeps up to max_concurrent_batches steps in flight.
    def submit(self, so: SchedulerOutput):
        """Start a step on every rank (stage 0's part runs here); -> a handle for finish()."""
        self._check()
        try:
            self._send_all("execute_model_worker", (so, self.driver_worker.take_sampled()))
            pending = self.driver_worker.submit_step(so)
        except Exception as e:
            raise self._failure(e)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        return pending

    def finish(self, handle) -> ModelRunnerOutput:
        """Wait for the oldest step's last stage, sample on the driver; -> its output."""
        self._check()
        try:
            if self.tp_size > 1:
                self._send_all("finish_step_worker", (), ranks=range(1, self.tp_size))
            out = self.driver_worker.finish_step(handle)
            self._after_step(wait=False)
        except Exception as e:
            raise self._failure(e)
        self._in_flight -= 1
        self.stats.steps += 1
        return out

    def _failure(self, e: Exception) -> ExecutorError:
        if isinstance(e, ExecutorError):
            return self._fail(e)
        dead = self._dead_worker(wait=5.0)
        msg = (
            f"{dead}; the engine cannot continue"
            if dead
            else f"a step of the split model failed on the driver: {type(e).__name__}: {e}"
        )
        err = self._fail(ExecutorError(msg))
        err.__cause__ = e
        return err

    def comm_stats(self) -> dict:
        """The driver's steps, and its time, calls and bytes in collectives so far."""
        return {**self.stats.as_dict(), "max_in_flight": self.max_in_flight}

    # ------------------------------------------------------------ health and the end
    def check_health(self) -> None:
        self._check()

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
            self.driver_worker.shutdown()  # leaves the process groups
            self.store = None
            self._restore_threads()
