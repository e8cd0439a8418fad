"""EngineCore: the scheduler and the model runner, one step at a time.

It owns the KV cache; it knows nothing of text. The server runs it in its own process.
"""
from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


class EngineCore:
    def __init__(self, config: EngineConfig, eos_ids: set[int]) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.runner.eos_ids = set(eos_ids)
        self.num_blocks = self._num_blocks()
        cc = config.cache_config
        self.num_cpu_blocks = 0
        if config.scheduler_config.preemption_mode == "swap":
            self.num_cpu_blocks = (cc.num_cpu_blocks if cc.num_cpu_blocks is not None
                                   else int(cc.swap_space * 2**30) // self.runner.kv_bytes_per_block())
        self.runner.init_kv_cache(self.num_blocks, self.num_cpu_blocks)
        kv = KVCacheManager(self.num_blocks, cc.block_size, enable_caching=cc.enable_prefix_caching,
                            num_cpu_blocks=self.num_cpu_blocks)
        self.scheduler = Scheduler(config.scheduler_config, kv)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", self.num_blocks,
                    cc.block_size, (self.num_blocks - 1) * cc.block_size,
                    self.num_blocks * self.runner.kv_bytes_per_block() / 2**30)

    def _num_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks
        # Enough for every sequence at full length, capped by the memory given to the cache.
        useful = sc.max_num_seqs * -(sc.max_model_len // -cc.block_size) + 1
        budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
        by_memory = budget // self.runner.kv_bytes_per_block()
        if by_memory < 2:
            raise ValueError(f"kv_cache_memory ({budget} bytes) holds fewer than 2 blocks of "
                             f"{self.runner.kv_bytes_per_block()} bytes")
        return int(min(useful, by_memory))

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        ro = self.runner.execute_model(so)
        return self.scheduler.update_from_output(so, ro)
