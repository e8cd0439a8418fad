"""Data parallelism: K engine-core replicas (each its own process, each possibly split by
tensor / pipeline parallelism) behind one API server, with the prefix-cache-aware router.

DPCoreClient has the face of CoreClient that AsyncLLM uses (wait_ready, send, recv,
call_utility, resolve_utility, mark_dead, shutdown, dead, proc), so the server is unchanged:

- "add": each request goes to the replica the router picks (dp_router.py); when every replica
  is at its limit the send raises EngineOverloadedError at once (HTTP 503 in the server).
- "beam": the search goes, whole, to the replica the router picks (its beams never leave it).
- "abort": to the replica that holds each request (a forked sample `{i}_{id}` to its parent's).
- recv(): the replicas' messages merged; utility replies are resolved here, finished outputs
  (and beam results, and requests a failed step ended) lower the router's load, and each message's stats are replaced by the sum
  over replicas.
- proc: a view of the K processes: alive while all are; its sentinel becomes readable when
  any of them ends (a dead replica takes the server's engine down, as one core's death does:
  the server exits, or with --restart-engine-on-failure starts all K replicas afresh).

make_core_client() picks CoreClient or DPCoreClient from parallel_config.data_parallel_size.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import threading
from multiprocessing.connection import wait as mp_wait
from typing import Optional

from pagedllm.engine import serial
from pagedllm.engine.dp_router import PrefixCacheAwareRouter, RouterOverloadedError
from pagedllm.engine.exceptions import EngineOverloadedError

logger = logging.getLogger("pagedllm.engine.dp_client")

_CHILD = re.compile(r"^\d+_(.+)$")
_SUMMED = ("running", "waiting", "used_blocks", "num_blocks", "preemptions", "num_added")


def make_core_client(config, eos_ids, log_level: str = "INFO"):
    from pagedllm.engine.core_client import CoreClient
    if config.parallel_config.data_parallel_size > 1:
        return DPCoreClient(config, eos_ids, log_level)
    return CoreClient(config, eos_ids, log_level)


class _Procs:
    """The K core processes seen as one."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self._r, self._w = os.pipe()
        self.sentinel = self._r
        threading.Thread(target=self._watch, daemon=True, name="pagedllm-dp-watch").start()

    def _watch(self) -> None:
        mp_wait([p.sentinel for p in self.procs])
        try:
            os.write(self._w, b"x")
        except OSError:
            pass

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def join(self, timeout: Optional[float] = None) -> None:
        for p in self.procs:
            if not p.is_alive():
                p.join(timeout)

    @property
    def exitcode(self) -> Optional[int]:
        codes = [p.exitcode for p in self.procs if p.exitcode is not None]
        return codes[0] if codes else None

    @property
    def pid(self) -> int:
        return self.procs[0].pid


class DPCoreClient:
    def __init__(self, config, eos_ids, log_level: str = "INFO", clients: Optional[list] = None,
                 max_load: Optional[int] = None) -> None:
        """clients: ready-made per-replica clients (tests); else K CoreClients are started.
        max_load: requests in flight per replica before it takes no more (default: the
        replica's max_num_seqs plus as many waiting)."""
        from pagedllm.engine.core_client import CoreClient
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
        self.dead = None
        self.stats: list[Optional[dict]] = [None] * len(clients)
        self._samples_left: dict[str, int] = {}   # parents with n > 1: children not yet ended
        self._queue: Optional[asyncio.Queue] = None
        self._pumps: list[asyncio.Task] = []
        procs = [getattr(c, "proc", None) for c in clients]
        self.proc = _Procs(procs) if all(p is not None for p in procs) else None

    # ------------------------------------------------------------ start
    async def wait_ready(self, timeout: float = 900.0) -> dict:
        readies = await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))
        blocks = [r["num_blocks"] for r in readies]
        self.router = PrefixCacheAwareRouter(len(self.clients), self.block_size, blocks,
                                             max_load=self.max_load)
        logger.info("data parallel: %d replicas (pids %s), %s KV blocks each",
                    len(self.clients), [r.get("pid") for r in readies], blocks)
        return {"num_blocks": min(blocks), "pid": readies[0].get("pid"),
                "pids": [r.get("pid") for r in readies]}

    # ------------------------------------------------------------ messages
    def _owner(self, req_id: str) -> Optional[int]:
        idx = self.router.owner.get(req_id)
        if idx is None:
            m = _CHILD.match(req_id)
            if m:
                idx = self.router.owner.get(m.group(1))
        return idx

    def send(self, msg: dict) -> None:
        if self.dead is not None:
            raise self.dead
        t = msg.get("t")
        if t == "add":
            by_replica: dict[int, list] = {}
            routed = []
            try:
                for enc in msg["r"]:
                    req_id, prompt_ids, extra = enc[0], enc[1], tuple(enc[6] or ())
                    d = self.router.route(req_id, prompt_ids, _tuples(extra))
                    routed.append(req_id)
                    sp = enc[2]
                    num_samples = sp.get("best_of") or sp.get("n") or 1
                    if num_samples > 1:
                        self._samples_left[req_id] = num_samples
                    by_replica.setdefault(d.replica, []).append(enc)
            except RouterOverloadedError as e:
                for req_id in routed:
                    self.router.finish(req_id)
                    self._samples_left.pop(req_id, None)
                raise EngineOverloadedError(f"The server is overloaded: {e}") from e
            for idx, encs in by_replica.items():
                self.clients[idx].send({**msg, "r": encs})
        elif t == "beam":
            enc = msg["r"]
            try:
                d = self.router.route(enc[0], enc[1], _tuples(tuple(enc[6] or ())))
            except RouterOverloadedError as e:
                raise EngineOverloadedError(f"The server is overloaded: {e}") from e
            self.clients[d.replica].send(msg)
        elif t == "abort":
            by_replica = {}
            for req_id in msg["ids"]:
                idx = self._owner(req_id)
                if idx is not None:
                    by_replica.setdefault(idx, []).append(req_id)
            for idx, ids in by_replica.items():
                self.clients[idx].send({**msg, "ids": ids})
            for req_id in msg["ids"]:
                self._ended(req_id, whole=True)
        else:   # shutdown (and anything else): every replica
            for c in self.clients:
                c.send(msg)

    async def recv(self) -> dict:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._pumps = [asyncio.get_running_loop().create_task(self._pump(i, c))
                           for i, c in enumerate(self.clients)]
        while True:
            idx, msg = await self._queue.get()
            t = msg.get("t")
            if t == "util":
                self.clients[idx].resolve_utility(msg)
                continue
            if "s" in msg:
                self.stats[idx] = msg["s"]
                msg = {**msg, "s": self.merged_stats()}
            if t == "out":
                for o in msg["o"]:
                    out = serial.decode_output(o)
                    if out.finish_reason is not None:
                        self._ended(out.req_id)
                for b in msg.get("b") or ():
                    self._ended(b[0])
                for f in msg.get("f") or ():
                    self._ended(f[0])
            return msg

    def _ended(self, req_id: str, whole: bool = False) -> None:
        """A core request ended: the router's load drops when its whole user request has
        (a parent with n > 1 when all its forked samples have, or when it is aborted)."""
        if req_id in self.router.owner:
            if whole or req_id not in self._samples_left:
                self._samples_left.pop(req_id, None)
                self.router.finish(req_id)
            return
        m = _CHILD.match(req_id)
        parent = m.group(1) if m else None
        if parent in self._samples_left:
            self._samples_left[parent] -= 1
            if self._samples_left[parent] <= 0:
                del self._samples_left[parent]
                self.router.finish(parent)

    async def _pump(self, idx: int, client) -> None:
        while True:
            msg = await client.recv()
            await self._queue.put((idx, msg))

    def merged_stats(self) -> dict:
        known = [s for s in self.stats if s]
        if not known:
            return {}
        out = {k: sum(s.get(k, 0) for s in known) for k in _SUMMED}
        out["kv_usage"] = out["used_blocks"] / out["num_blocks"] if out["num_blocks"] else 0.0
        out["replicas"] = [dict(s) if s else None for s in self.stats]
        out["router_loads"] = self.router.loads() if self.router else []
        return out

    async def call_utility(self, method: str, *args, timeout: float = 10.0):
        results = await asyncio.gather(*(c.call_utility(method, *args, timeout=timeout) for c in self.clients))
        if method == "get_stats":
            for i, r in enumerate(results):
                self.stats[i] = r
            return self.merged_stats()
        return results[0] if all(r == results[0] for r in results) else results

    def resolve_utility(self, msg: dict) -> None:   # replies are resolved in recv()
        pass

    def mark_dead(self, err) -> None:
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


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v
