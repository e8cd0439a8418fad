"""Worker: one rank of an engine replica, holding its model runner.

The same class serves every rank: the only one of a one-process engine (uniproc executor),
the driver (rank 0) of a split model, beside the scheduler, and the other ranks behind an mp
worker process (executor/worker_main.py) or a Ray actor. It joins the process groups
(`init_device`), builds the runner over the whole model or its shard (`load_model`) and
forwards the executor's calls to it. Only rank 0 samples.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.cpu_malloc import keep_freed_memory
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        rank: int = 0,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        host: Optional[str] = None,
        num_threads: Optional[int] = None,
    ) -> None:
        """master_addr / master_port: rank 0's store (a split model); host: this rank's address
        for its Gloo device (None on a Ray actor: its node's); num_threads: torch threads of
        this rank (None: leave them)."""
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.rank = rank
        self.master_addr, self.master_port, self.host = master_addr, master_port, host
        self.num_threads = num_threads
        self.parallel = None  # distributed.parallel_state.ParallelContext of a split model
        self.model_runner: Optional[ModelRunner] = None
        self.kv_connector = None  # worker/kv_connector_worker.KVConnectorWorker, with --kv-transfer-config

    def get_pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------ start-up
    def init_device(self, store=None) -> None:
        """Join the process groups of a split model (store: rank 0's own TCPStore)."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        pc = self.config.parallel_config
        if pc.world_size == 1:
            return
        from pagedllm.distributed.parallel_state import init_parallel_context

        if self.host is None:  # a Ray actor: this node's address
            import ray

            self.host = ray.util.get_node_ip_address()
        self.parallel = init_parallel_context(
            self.config.model_config.hf_config,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            self.rank,
            self.master_addr,
            self.master_port,
            self.host,
            store=store,
        )

    def load_model(self):
        """Build this rank's runner (it loads the weights); -> its KV bytes per block and its
        layers' KV cache layout (core/kv_cache_utils.KVCacheConfig)."""
        if self.parallel is None:
            self.model_runner = ModelRunner(self.config, eos_token_ids=self.eos_token_ids)
        else:
            from pagedllm.worker.parallel_model_runner import ParallelModelRunner

            self.model_runner = ParallelModelRunner(self.config, self.parallel, self.eos_token_ids)
        if self.config.device_config.device == "cpu":
            # The steps' activations reuse their pages (worker/cpu_malloc.py); set after the
            # weights are loaded, so that the loader's freed buffers go back to the kernel.
            keep_freed_memory()
        return self.model_runner.kv_bytes_per_block(), self.model_runner.kv_cache_config

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def determine_available_memory(self) -> int:
        return self.model_runner.profile_kv_cache_memory()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.model_runner.init_kv_cache(num_blocks, num_cpu_blocks)
        if self.config.kv_transfer_config is not None:  # P/D disaggregation (one-process engines)
            from pagedllm.worker.kv_connector_worker import KVConnectorWorker

            self.kv_connector = KVConnectorWorker(self.config, self.model_runner)

    # ------------------------------------------------------------ steps: rank 0
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_connector is not None:
            return self.kv_connector.execute_model(self.model_runner, so)
        return self.model_runner.execute_model(so)

    def submit_step(self, so: SchedulerOutput):
        return self.model_runner.submit_step(so)

    def finish_step(self, pending) -> ModelRunnerOutput:
        return self.model_runner.finish_step(pending)

    def take_sampled(self) -> dict[str, list[int]]:
        return self.model_runner.take_sampled()

    def reset(self) -> None:
        self.model_runner.reset()

    # ------------------------------------------------------------ steps: the other ranks
    def execute_model_worker(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        self.model_runner.execute_model_worker(so, sampled)

    def finish_step_worker(self) -> None:
        self.model_runner.finish_step_worker()

    # ------------------------------------------------------------ the end
    def comm_stats(self) -> dict:
        return self.parallel.stats.as_dict() if self.parallel else {}

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
        if self.parallel is not None:
            self.parallel.close()
            self.parallel = None
