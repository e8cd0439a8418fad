"""The mp executor: ranks 1..world_size-1 in local processes, each with a socket pair for its
control messages. A worker starts from its own module (`python -m pagedllm.executor.worker_main`),
so the engine works from a notebook, `python -c` or a script on stdin, without a `__main__`
guard. Workers end with the driver: a graceful shutdown message, else SIGTERM, else SIGKILL;
and on their own when the driver's end of the socket closes (the driver died) or the parent
process is gone."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection
from typing import Optional

import pagedllm
from pagedllm.executor.abstract import ExecutorError
from pagedllm.executor.distributed_executor import DistributedExecutor

logger = logging.getLogger(__name__)


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerProcess(subprocess.Popen):
    """A worker process with multiprocessing.Process's face (is_alive, exitcode, join)."""

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self.poll()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def start_worker(**kwargs) -> tuple[WorkerProcess, Connection]:
    """Start `python -m pagedllm.executor.worker_main` and hand it run_worker_process's arguments
    over a new socket pair -> (the process, the driver's end)."""
    ours, theirs = socket.socketpair()
    # The child imports pagedllm from where this process did (a checkout on sys.path too).
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with theirs:
        proc = WorkerProcess(
            [sys.executable, "-m", "pagedllm.executor.worker_main", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
    conn = Connection(ours.detach())
    conn.send(kwargs)
    return proc, conn


def _reap(procs: list, stats_box: list) -> None:
    """Last resort (garbage collection, interpreter exit): no worker outlives the driver."""
    if stats_box and stats_box[0].steps:
        logger.info("mp executor, driver's communication: %s", stats_box[0].summary())
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


class MultiprocExecutor(DistributedExecutor):
    backend_name = "mp"

    def _start_workers(self) -> None:
        self.procs: list[WorkerProcess] = []
        self.conns: list[Connection] = []
        self._errors: dict[int, str] = {}
        # Answers read while watching for dead workers (a worker answers as soon as it has
        # joined the groups, maybe before the driver's own join returns): _collect_all's.
        self._answers: dict[int, object] = {}
        self._finalizer = weakref.finalize(self, _reap, self.procs, self._stats_box)
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.world_size):
            p, conn = start_worker(
                config=self.config,
                eos_token_ids=self.eos_token_ids,
                rank=rank,
                master_addr=self.host,
                master_port=self.master_port,
                host=self.host,
                num_threads=self.num_threads,
                log_level=level,
            )
            self.procs.append(p)
            self.conns.append(conn)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in getattr(self, "procs", [])]

    def _send_all(self, method: str, args: tuple, ranks=None) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            if ranks is not None and rank not in ranks:
                continue
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, OSError) as e:
                dead = self._dead_worker(wait=2.0)
                raise ExecutorError(
                    f"{dead or f'worker rank {rank} is unreachable ({e})'}; the engine cannot continue"
                ) from e

    def _collect_all(self, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        results = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if rank in self._answers:
                results.append(self._answers.pop(rank))
                continue
            while True:
                if conn.poll(0.2):
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        raise ExecutorError(
                            f"worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)} while {what}"
                        ) from None
                    if kind == "error":
                        raise ExecutorError(value)
                    results.append(value)
                    break
                if not p.is_alive():
                    raise ExecutorError(f"worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)} while {what}")
                if time.monotonic() > deadline:
                    raise ExecutorError(f"worker rank {rank} did not answer within {timeout:.0f} s while {what}")
        return results

    def _dead_worker(self, wait: float = 0.0) -> Optional[str]:
        deadline = time.monotonic() + wait
        while True:
            for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
                try:
                    if conn.poll(0):
                        kind, value = conn.recv()
                        if kind == "error":
                            self._errors[rank] = value
                        else:
                            self._answers[rank] = value
                except (EOFError, OSError):
                    pass
                if rank in self._errors:
                    return self._errors[rank]
                if p.exitcode is not None:
                    return f"worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _stop_workers(self) -> None:
        procs = getattr(self, "procs", [])
        for p, conn in zip(procs, self.conns):
            if p.is_alive():
                try:
                    conn.send(("shutdown", ()))
                except Exception:
                    pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in getattr(self, "conns", []):
            conn.close()
        if procs:
            self._finalizer.detach()
