"""Data parallelism: K engine-core replicas (each its own process, each possibly split by
tensor / pipeline parallelism) behind one API server, with the prefix-cache-aware router.

DPCoreClient is an EngineCoreClient, so AsyncLLM does not know it is talking to K cores:

- add: each request goes to the replica the router picks (dp_router.py); when every replica
  is at its limit the send raises EngineOverloadedError at once (HTTP 503 in the server).
- beam search: the search goes, whole, to the replica the router picks (its beams never leave it).
- abort: to the replica that holds each request (a forked sample to its parent's: the sample
  ids of a parent with n > 1 are registered when it is routed).
- get_output(): the replicas' outputs merged; finished outputs (and beam results, and
  requests a failed step ended) lower the router's load, and each message's stats are
  replaced by the sum over replicas.
- liveness: alive while all replicas are; every replica's sentinel is watched (a dead replica
  takes the server's engine down, as one core's death does: the server exits, or with
  --restart-engine-on-failure starts all K replicas afresh).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from typing import Optional

from pagedllm.engine import messages as m
from pagedllm.engine.core_client import CoreClient, EngineCoreClient
from pagedllm.engine.dp_router import PrefixCacheAwareRouter, RouterOverloadedError
from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError
from pagedllm.request import child_request_id

logger = logging.getLogger("pagedllm.engine.dp_client")

_SUMMED = (
    "running",
    "waiting",
    "used_blocks",
    "num_blocks",
    "preemptions",
    "num_added",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "mm_cache_queries",
    "mm_cache_hits",
)


class DPCoreClient(EngineCoreClient):
    def __init__(
        self,
        config,
        eos_ids,
        log_level: str = "INFO",
        clients: Optional[list[EngineCoreClient]] = None,
        max_load: Optional[int] = None,
    ) -> None:
        """clients: ready-made per-replica clients (tests); else K CoreClients are started.
        max_load: requests in flight per replica before it takes no more (default: the
        replica's max_num_seqs plus as many waiting)."""
        k = config.parallel_config.data_parallel_size
        if clients is None:
            replica = copy.deepcopy(config)
            replica.parallel_config.data_parallel_size = 1
            clients = []
            try:
                for _ in range(k):
                    clients.append(CoreClient(replica, eos_ids, log_level))
            except BaseException:
                for c in clients:
                    c.shutdown(timeout=2)
                raise
        self.clients = clients
        self.config = config
        self.block_size = config.cache_config.block_size
        self.max_load = max_load if max_load is not None else 2 * config.scheduler_config.max_num_seqs
        self.router: Optional[PrefixCacheAwareRouter] = None
        self.dead: Optional[EngineDeadError] = None
        self.stats: list[Optional[m.SchedulerStats]] = [None] * len(clients)
        # Parents with n > 1, while routed: their sample ids and those not yet ended; and
        # each sample's parent (core outputs and aborts name samples).
        self._samples: dict[str, tuple[list[str], set[str]]] = {}
        self._parent_of: dict[str, str] = {}
        self._queue: Optional[asyncio.Queue] = None
        self._pumps: list[asyncio.Task] = []

    # ------------------------------------------------------------ start
    async def wait_ready(self, timeout: float = 900.0) -> m.EngineCoreReady:
        readies = await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))
        blocks = [r.num_blocks for r in readies]
        self.router = PrefixCacheAwareRouter(len(self.clients), self.block_size, blocks, max_load=self.max_load)
        logger.info(
            "data parallel: %d replicas (pids %s), %s KV blocks each",
            len(self.clients),
            [r.pid for r in readies],
            blocks,
        )
        return m.EngineCoreReady(num_blocks=min(blocks), pid=readies[0].pid, kv_cache_config=readies[0].kv_cache_config)

    # ------------------------------------------------------------ requests
    def _route(self, req: m.EngineCoreRequest) -> int:
        try:
            return self.router.route(req.request_id, req.prompt_token_ids, req.extra_keys).replica
        except RouterOverloadedError as e:
            raise EngineOverloadedError(f"The server is overloaded: {e}") from e

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def add_requests(self, requests: list[m.EngineCoreRequest]) -> None:
        self._check_alive()
        by_replica: dict[int, list[m.EngineCoreRequest]] = {}
        routed = []
        try:
            for req in requests:
                by_replica.setdefault(self._route(req), []).append(req)
                routed.append(req.request_id)
                num_samples = req.sampling_params.num_samples
                if num_samples > 1:
                    samples = [child_request_id(req.request_id, i) for i in range(num_samples)]
                    self._samples[req.request_id] = (samples, set(samples))
                    self._parent_of.update(dict.fromkeys(samples, req.request_id))
        except EngineOverloadedError:
            for req_id in routed:  # nothing of the batch stays routed
                self._finish(req_id)
            raise
        for idx, reqs in by_replica.items():
            self.clients[idx].add_requests(reqs)

    def add_beam_search(self, start: m.BeamSearchStart) -> None:
        self._check_alive()
        self.clients[self._route(start.request)].add_beam_search(start)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        by_replica: dict[int, list[str]] = {}
        for req_id in request_ids:
            idx = self.router.owner.get(self._parent_of.get(req_id, req_id))
            if idx is not None:
                by_replica.setdefault(idx, []).append(req_id)
        for idx, ids in by_replica.items():
            self.clients[idx].abort_requests(ids)
        for req_id in request_ids:
            self._ended(req_id, whole=True)

    def _ended(self, req_id: str, whole: bool = False) -> None:
        """A core request ended: the router's load drops when its whole user request has
        (a parent with n > 1 when all its forked samples have, or when it is aborted)."""
        if req_id in self.router.owner:
            if whole or req_id not in self._samples:
                self._finish(req_id)
            return
        parent = self._parent_of.get(req_id)
        if parent is not None:
            left = self._samples[parent][1]
            left.discard(req_id)
            if not left:
                self._finish(parent)

    def _finish(self, req_id: str) -> None:
        samples, _ = self._samples.pop(req_id, ((), None))
        for sample in samples:
            self._parent_of.pop(sample, None)
        self.router.finish(req_id)

    # ------------------------------------------------------------ outputs
    async def get_output(self) -> m.EngineCoreOutputs:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._pumps = [asyncio.get_running_loop().create_task(self._pump(i, c)) for i, c in enumerate(self.clients)]
        idx, outs = await self._queue.get()
        if isinstance(outs, BaseException):
            raise outs
        if outs.scheduler_stats is not None:
            self.stats[idx] = outs.scheduler_stats
            outs.scheduler_stats = self.merged_stats()
        for o in outs.outputs:
            if o.finish_reason is not None:
                self._ended(o.req_id)
        for b in outs.beam_results:
            self._ended(b.output.request_id)
        for f in outs.failed:
            self._ended(f.request_id)
        return outs

    async def _pump(self, idx: int, client: EngineCoreClient) -> None:
        while True:
            try:
                outs = await client.get_output()
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # a replica's failure is the engine's
                await self._queue.put((idx, e))
                return
            await self._queue.put((idx, outs))

    def merged_stats(self) -> m.SchedulerStats:
        known = [s for s in self.stats if s is not None]
        total = {k: sum(getattr(s, k) for s in known) for k in _SUMMED}
        usage = total["used_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
        return m.SchedulerStats(
            **total, kv_usage=usage, replicas=list(self.stats), router_loads=self.router.loads() if self.router else []
        )

    async def call_utility(self, method: str, *args, timeout: float = 10.0):
        results = await asyncio.gather(*(c.call_utility(method, *args, timeout=timeout) for c in self.clients))
        return results[0] if all(r == results[0] for r in results) else results

    async def get_stats(self, timeout: float = 10.0) -> m.SchedulerStats:
        self.stats = list(await asyncio.gather(*(c.get_stats(timeout) for c in self.clients)))
        return self.merged_stats()

    # ------------------------------------------------------------ liveness
    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    @property
    def exit_code(self) -> Optional[int]:
        return next((code for c in self.clients if (code := c.exit_code) is not None), None)

    def sentinels(self) -> list[int]:
        return [fd for c in self.clients for fd in c.sentinels()]

    def mark_dead(self, err: EngineDeadError) -> None:
        if self.dead is None:
            self.dead = err
        for c in self.clients:
            c.mark_dead(err)

    def shutdown(self, timeout: float = 10.0) -> None:
        for t in self._pumps:
            t.cancel()
        threads = [threading.Thread(target=c.shutdown, args=(timeout,)) for c in self.clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
