"""The server side of the EngineCore process: starts it, talks to it over ZMQ, stops it.

Two ipc sockets in a private temp directory, both bound here: PUSH (server -> core: add,
abort, utility, shutdown) and PULL (core -> server: ready, outputs, stats, utility replies,
error). Sends never block: a core that is gone turns into EngineDeadError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Optional

import zmq
import zmq.asyncio

from pagedllm.engine import serial
from pagedllm.engine.exceptions import EngineDeadError

logger = logging.getLogger("pagedllm.engine.core_client")


class CoreClient:
    def __init__(self, config, eos_ids, log_level: str = "INFO") -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-core-")
        self.input_addr = f"ipc://{self._tmpdir}/input"
        self.output_addr = f"ipc://{self._tmpdir}/output"
        self._sync_ctx = zmq.Context()
        self._in = self._sync_ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.SNDHWM, 0)  # never drop, never block on the count
        self._in.bind(self.input_addr)
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self.output_addr)
        from pagedllm.engine.core_proc import run_engine_core
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, name="pagedllm-engine-core",
                               args=(config, sorted(eos_ids), self.input_addr, self.output_addr,
                                     os.getpid(), log_level))
        self.proc.start()
        self._util_ids = itertools.count()
        self._util_futures: dict[int, asyncio.Future] = {}
        self.dead: Optional[EngineDeadError] = None
        self._closed = False

    # ------------------------------------------------------------ start
    async def wait_ready(self, timeout: float = 900.0) -> dict:
        """The core's ready message ({"num_blocks", "pid"}); RuntimeError if it fails to start."""
        deadline = time.monotonic() + timeout
        while True:
            if await self._out.poll(500):
                msg = serial.unpack(await self._out.recv())
                if msg.get("t") == "ready":
                    return msg
                if msg.get("t") == "error":
                    if msg.get("exc") == "ValueError":  # a bad setting: said plainly, like the other commands
                        raise ValueError(msg.get("msg", ""))
                    raise RuntimeError(f"the engine core failed to start: {msg.get('exc')}: {msg.get('msg')}")
                continue
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up "
                                   f"(exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")

    # ------------------------------------------------------------ messages
    def send(self, msg: dict) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self._in.send(serial.pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    async def recv(self) -> dict:
        return serial.unpack(await self._out.recv())

    async def call_utility(self, method: str, *args, timeout: float = 10.0):
        call_id = next(self._util_ids)
        fut = asyncio.get_running_loop().create_future()
        self._util_futures[call_id] = fut
        try:
            self.send({"t": "util", "id": call_id, "m": method, "a": list(args)})
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._util_futures.pop(call_id, None)

    def resolve_utility(self, msg: dict) -> None:
        fut = self._util_futures.get(msg["id"])
        if fut is None or fut.done():
            return
        if msg.get("e"):
            fut.set_exception(RuntimeError(msg["e"]))
        else:
            fut.set_result(msg.get("r"))

    def mark_dead(self, err: EngineDeadError) -> None:
        if self.dead is None:
            self.dead = err
        for fut in self._util_futures.values():
            if not fut.done():
                fut.set_exception(err)

    # ------------------------------------------------------------ stop
    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, then SIGTERM, then SIGKILL; close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            try:
                self._in.send(serial.pack({"t": "shutdown"}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("engine core did not stop in %.0f s: SIGTERM", timeout)
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            logger.warning("engine core did not stop: SIGKILL")
            self.proc.kill()
            self.proc.join(5)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
