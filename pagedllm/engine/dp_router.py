"""The data-parallel router: which of K engine replicas gets a request.

Each replica has its own KV cache, so a request is cheapest where its prefix is already
cached; but sending every request with a popular prefix to one replica would leave the others
idle while it queues. The router follows the rule of Mooncake's conductor (balance the cache
hit against the queue):

1. For each replica, the cached prefix of the request: the longest run of its leading full
   blocks whose hashes the replica holds. Hashes are computed exactly as the replica's
   KVCacheManager computes them (core.kv_cache_manager.hash_block_tokens: parent hash, block
   tokens, extra keys), and the router tracks each replica's cache from what it sent there:
   an LRU set of block hashes bounded by the replica's number of blocks.
2. The replica with the longest hit wins (ties: the less loaded), unless its load (requests in
   flight) exceeds the least loaded replica's by more than max(balance_abs,
   balance_ratio x that load): then the least loaded wins (ties: the longer hit, then round
   robin). With no hit anywhere, the least loaded wins: unrelated load spreads evenly.
3. A replica with max_load requests in flight takes no more; when every replica is there the
   request is refused at once (RouterOverloadedError), not queued.

Plain Python, no torch: tested with a fake engine (tests/test_parallel_router.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedllm.core.kv_cache_manager import extend_block_hashes


class RouterOverloadedError(RuntimeError):
    """Every replica is at its limit of requests in flight."""


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[int]:
    """The hashes of the full blocks of token_ids, chained as the KV cache manager chains them."""
    return extend_block_hashes([], token_ids, block_size, extra_keys)


@dataclass
class ReplicaState:
    index: int
    capacity_blocks: int
    cached: "OrderedDict[int, None]" = field(default_factory=OrderedDict)  # LRU: oldest first
    in_flight: set = field(default_factory=set)
    num_routed: int = 0

    @property
    def load(self) -> int:
        return len(self.in_flight)

    def prefix_hit(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        while len(self.cached) > self.capacity_blocks:
            self.cached.popitem(last=False)


@dataclass
class RouteDecision:
    replica: int
    hit_blocks: int  # cached prefix of the request on that replica, in blocks
    reason: str  # "prefix" (longest hit), "balance" (hit overruled by load), "least-loaded"


class PrefixCacheAwareRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        capacity_blocks: int | Sequence[int],
        max_load: Optional[int] = None,
        balance_abs: int = 4,
        balance_ratio: float = 0.5,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        caps = [capacity_blocks] * num_replicas if isinstance(capacity_blocks, int) else list(capacity_blocks)
        if len(caps) != num_replicas:
            raise ValueError(f"{len(caps)} capacities for {num_replicas} replicas")
        self.block_size = block_size
        self.replicas = [ReplicaState(i, c) for i, c in enumerate(caps)]
        self.max_load = max_load
        self.balance_abs = balance_abs
        self.balance_ratio = balance_ratio
        self.owner: dict[str, int] = {}
        self._rr = 0  # round-robin start among ties

    # ------------------------------------------------------------ decisions
    def choose(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> tuple[RouteDecision, list[int]]:
        """The decision for a request (no state changes) and its block hashes."""
        hashes = prompt_block_hashes(token_ids, self.block_size, tuple(extra_keys))
        open_ = [r for r in self.replicas if self.max_load is None or r.load < self.max_load]
        if not open_:
            raise RouterOverloadedError(
                f"all {len(self.replicas)} replicas are at their limit of {self.max_load} requests "
                "in flight; please retry later"
            )
        hits = {r.index: r.prefix_hit(hashes) for r in open_}
        min_load = min(r.load for r in open_)
        n = len(self.replicas)
        rr = {r.index: (r.index - self._rr) % n for r in open_}  # rotating tie-break
        best = max(open_, key=lambda r: (hits[r.index], -r.load, -rr[r.index]))
        least = min(open_, key=lambda r: (r.load, -hits[r.index], rr[r.index]))
        if hits[best.index] > 0:
            slack = max(self.balance_abs, self.balance_ratio * min_load)
            if best.load - min_load <= slack:
                return RouteDecision(best.index, hits[best.index], "prefix"), hashes
            return RouteDecision(least.index, hits[least.index], "balance"), hashes
        return RouteDecision(least.index, 0, "least-loaded"), hashes

    def route(self, req_id: str, token_ids: Sequence[int], extra_keys: tuple = ()) -> RouteDecision:
        """Choose a replica for the request and account for it (load, cached blocks)."""
        if req_id in self.owner:
            raise ValueError(f"request_id {req_id!r} is already routed")
        decision, hashes = self.choose(token_ids, extra_keys)
        r = self.replicas[decision.replica]
        r.in_flight.add(req_id)
        r.num_routed += 1
        r.remember(hashes)
        self.owner[req_id] = r.index
        self._rr = (self._rr + 1) % len(self.replicas)
        return decision

    def finish(self, req_id: str) -> Optional[int]:
        """The request ended (finished or aborted): its replica's load drops. -> its replica."""
        idx = self.owner.pop(req_id, None)
        if idx is not None:
            self.replicas[idx].in_flight.discard(req_id)
        return idx

    def loads(self) -> list[int]:
        return [r.load for r in self.replicas]

    def num_routed(self) -> list[int]:
        return [r.num_routed for r in self.replicas]
