"""Process groups for tensor and pipeline parallelism, and the collectives the model uses.

Every group is a torch.distributed backend (Gloo on CPUs, NCCL on GPUs) built over one
TCPStore that the driver hosts: no global default process group, so several engines can live
in one process one after the other (tests) and a failed one is dropped without touching the
others. Collectives carry a timeout (PAGEDLLM_DIST_TIMEOUT_S, default 300 s); a peer that dies
makes them fail at once ("Connection closed by peer"), so a dead worker never hangs the driver.

Each collective is timed (CommStats): `pagedllm bench throughput` reports communication time
per step from it.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.distributed.sharding import ModelShard, plan_model_shard

TAG_FORWARD = 0  # hidden states from stage s to stage s + 1
TAG_RETURN = 1  # final hidden states of the sampled rows, last stage -> stage 0


def dist_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.PAGEDLLM_DIST_TIMEOUT_S)


@dataclass
class CommStats:
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0
    steps: int = 0  # model steps run (counted by the executor)

    def add(self, t0: float, nbytes: int) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += nbytes

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "calls": self.calls, "bytes": self.bytes, "steps": self.steps}

    def summary(self) -> str:
        per = max(self.steps, 1)
        return (
            f"{self.steps} steps, {self.calls} collectives ({self.calls / per:.0f} per step), "
            f"{self.bytes / 2**20:.1f} MiB, {self.seconds:.2f} s in collectives "
            f"({1000 * self.seconds / per:.2f} ms per step)"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_backend(store: dist.Store, prefix: str, rank: int, size: int, host: str, timeout: datetime.timedelta):
    """A Gloo backend bound to `host` (the node's address: 127.0.0.1 on one machine)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


class GroupComm:
    """A process group over `ranks` (global ranks, in order), seen from one member."""

    def __init__(self, backend, ranks: list[int], rank: int, stats: CommStats) -> None:
        self.backend = backend  # None when the group has one member
        self.ranks = ranks
        self.rank_in_group = ranks.index(rank)
        self.size = len(ranks)
        self.stats = stats

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (also returned)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        self.backend.allreduce([t]).wait()
        self.stats.add(t0, _nbytes(t))
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Every member's `t` (same shape) as a list on member `dst`; None elsewhere."""
        if self.size == 1:
            return [t]
        t0 = time.perf_counter()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        if self.rank_in_group == dst:
            out = [torch.empty_like(t) for _ in range(self.size)]
            self.backend.gather([out], [t], opts).wait()
        else:
            out = None
            self.backend.gather([], [t], opts).wait()
        self.stats.add(t0, _nbytes(t))
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t0 = time.perf_counter()
        self.backend.send([t], dst, tag).wait()
        self.stats.add(t0, _nbytes(t))

    def isend(self, t: torch.Tensor, dst: int, tag: int):
        """Start a send; -> its work (wait() returns once the receiver has taken it)."""
        self.stats.calls += 1
        self.stats.bytes += _nbytes(t)
        return self.backend.send([t], dst, tag)

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.stats.seconds += time.perf_counter() - t0

    def recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.backend.recv([t], src, tag).wait()
        self.stats.add(t0, _nbytes(t))
        return t

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.shutdown()
            except Exception:  # a peer already gone: nothing left to close cleanly
                pass
            self.backend = None


class ParallelContext:
    """One rank's view: its shard of the model, its TP group, and the world group that
    carries the pipeline's point-to-point hand-offs."""

    def __init__(
        self,
        rank: int,
        tp_size: int,
        pp_size: int,
        shard: ModelShard,
        world: GroupComm,
        tp: GroupComm,
        stats: CommStats,
    ) -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.world_size = tp_size * pp_size
        self.shard = shard
        self.world = world
        self.tp = tp
        self.stats = stats
        self.tp_rank = rank % tp_size
        self.pp_rank = rank // tp_size
        # Pipeline sends are asynchronous (a Gloo send completes only once the receiver has
        # posted its receive, and with several steps in flight the receiver may be busy):
        # one outstanding send per channel, waited for before the next one on it.
        self._sends: dict[tuple[int, int], tuple] = {}

    @property
    def is_first_stage(self) -> bool:
        return self.shard.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.shard.is_last_stage

    # Pipeline hand-offs: TP rank t of one stage talks to TP rank t of the other.
    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        prev = self._sends.pop((dst, tag), None)
        if prev is not None:
            self.world.wait(prev[0])
        t = t.contiguous()
        self._sends[(dst, tag)] = (self.world.isend(t, dst, tag), t)  # keep t alive until sent

    def send_next(self, hidden: torch.Tensor) -> None:
        self._isend(hidden, self.rank + self.tp_size, TAG_FORWARD)

    def recv_prev(self, buf: torch.Tensor) -> torch.Tensor:
        return self.world.recv(buf, self.rank - self.tp_size, TAG_FORWARD)

    def send_to_first(self, rows: torch.Tensor) -> None:
        self._isend(rows, self.tp_rank, TAG_RETURN)

    def recv_from_last(self, buf: torch.Tensor) -> torch.Tensor:
        return self.world.recv(buf, (self.pp_size - 1) * self.tp_size + self.tp_rank, TAG_RETURN)

    def close(self) -> None:
        self._sends.clear()
        self.tp.close()
        self.world.close()


def init_parallel_context(
    hf_config: dict,
    tp_size: int,
    pp_size: int,
    rank: int,
    master_addr: str,
    master_port: int,
    host: str = "127.0.0.1",
    store: Optional[dist.Store] = None,
) -> ParallelContext:
    """Join the groups of rank `rank`. The driver passes the store it hosts; the others connect
    to master_addr:master_port. Blocks until every rank has joined (or the timeout)."""
    world_size = tp_size * pp_size
    timeout = dist_timeout()
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    stats = CommStats()
    shard = plan_model_shard(hf_config, tp_size, pp_size, rank)
    pp_rank = rank // tp_size
    world = GroupComm(
        make_backend(store, "world", rank, world_size, host, timeout), list(range(world_size)), rank, stats
    )
    tp_ranks = list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))
    tp_backend = (
        make_backend(store, f"tp{pp_rank}", rank - pp_rank * tp_size, tp_size, host, timeout) if tp_size > 1 else None
    )
    tp = GroupComm(tp_backend, tp_ranks, rank, stats)
    return ParallelContext(rank, tp_size, pp_size, shard, world, tp, stats)
