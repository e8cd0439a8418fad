"""The server side of the EngineCore process: EngineCoreClient (what AsyncLLM uses) and
CoreClient, which starts one core process, talks to it over ZMQ and stops it.

Two ipc sockets in a private temp directory, both bound here: PUSH (server -> core: add,
beam, abort, utility, shutdown) and PULL (core -> server: ready, outputs, utility replies,
error). Sends never block: a core that is gone turns into EngineDeadError. The messages are
engine/messages.py's Structs; utility replies are resolved here, so get_output() returns
only the core's outputs.
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
from multiprocessing.connection import wait as mp_wait
from typing import Optional

import msgspec
import zmq
import zmq.asyncio

from pagedllm.engine import messages as m
from pagedllm.engine.exceptions import EngineDeadError

logger = logging.getLogger("pagedllm.engine.core_client")


class EngineCoreClient:
    """The engine core(s) as AsyncLLM sees them: typed sends, one stream of outputs, utility
    calls, and liveness (is_alive, exit_code, sentinels) instead of a process object.
    Implemented by CoreClient (one core process) and DPCoreClient (data parallel)."""

    dead: Optional[EngineDeadError] = None

    async def wait_ready(self, timeout: float = 900.0) -> m.EngineCoreReady:
        raise NotImplementedError

    # ------------------------------------------------------------ requests
    def add_requests(self, requests: list[m.EngineCoreRequest]) -> None:
        raise NotImplementedError

    def add_beam_search(self, start: m.BeamSearchStart) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output(self) -> m.EngineCoreOutputs:
        """The next outputs (or stats) message; EngineDeadError when the core reports it failed."""
        raise NotImplementedError

    async def call_utility(self, method: str, *args, timeout: float = 10.0):
        raise NotImplementedError

    async def get_stats(self, timeout: float = 10.0) -> m.SchedulerStats:
        return msgspec.convert(await self.call_utility("get_stats", timeout=timeout), m.SchedulerStats)

    # ------------------------------------------------------------ liveness
    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def exit_code(self) -> Optional[int]:
        """The exit code of a core process that ended (the first, with several), else None."""
        raise NotImplementedError

    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a core process ends."""
        raise NotImplementedError

    def mark_dead(self, err: EngineDeadError) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class CoreClient(EngineCoreClient):
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
        self._proc = mp.Process(
            target=run_engine_core,
            name="pagedllm-engine-core",
            args=(config, sorted(eos_ids), self.input_addr, self.output_addr, os.getpid(), log_level),
        )
        self._proc.start()
        self._util_ids = itertools.count()
        self._util_futures: dict[int, asyncio.Future] = {}
        self.dead: Optional[EngineDeadError] = None
        self._closed = False

    # ------------------------------------------------------------ start
    async def wait_ready(self, timeout: float = 900.0) -> m.EngineCoreReady:
        """The core's ready message; RuntimeError (ValueError: a bad setting) if it fails to start."""
        deadline = time.monotonic() + timeout
        while True:
            if await self._out.poll(500):
                msg = m.decode_output(await self._out.recv())
                if isinstance(msg, m.EngineCoreReady):
                    return msg
                if isinstance(msg, m.EngineCoreError):
                    if msg.exc_type == "ValueError":  # a bad setting: said plainly, like the other commands
                        raise ValueError(msg.message)
                    raise RuntimeError(f"the engine core failed to start: {msg.exc_type}: {msg.message}")
                continue
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")

    # ------------------------------------------------------------ messages
    def _send(self, msg: m.CoreRequest) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self._in.send_multipart(m.encode_request(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    def add_requests(self, requests: list[m.EngineCoreRequest]) -> None:
        self._send(m.AddRequests(requests))

    def add_beam_search(self, start: m.BeamSearchStart) -> None:
        self._send(start)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(m.AbortRequests(request_ids))

    async def get_output(self) -> m.EngineCoreOutputs:
        while True:
            msg = m.decode_output(await self._out.recv())
            if isinstance(msg, m.EngineCoreOutputs):
                return msg
            if isinstance(msg, m.UtilityOutput):
                self._resolve_utility(msg)
            elif isinstance(msg, m.EngineCoreError):
                raise EngineDeadError(f"the engine core failed: {msg.exc_type}: {msg.message}")
            else:
                raise m.ProtocolError(f"unexpected message from the engine core: {type(msg).__name__}")

    async def call_utility(self, method: str, *args, timeout: float = 10.0):
        call_id = next(self._util_ids)
        fut = asyncio.get_running_loop().create_future()
        self._util_futures[call_id] = fut
        try:
            self._send(m.UtilityRequest(call_id, method, list(args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._util_futures.pop(call_id, None)

    def _resolve_utility(self, msg: m.UtilityOutput) -> None:
        fut = self._util_futures.get(msg.call_id)
        if fut is None or fut.done():
            return
        if msg.error:
            fut.set_exception(RuntimeError(msg.error))
        else:
            fut.set_result(msg.result)

    # ------------------------------------------------------------ liveness
    def is_alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exit_code(self) -> Optional[int]:
        # The sentinel fires as the process closes its files, a moment before it can be reaped.
        if self._proc.exitcode is None and mp_wait([self._proc.sentinel], 0):
            self._proc.join(1.0)
        return self._proc.exitcode

    def sentinels(self) -> list[int]:
        return [self._proc.sentinel]

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
        if self._proc.is_alive():
            try:
                self._in.send_multipart(m.encode_request(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine core did not stop in %.0f s: SIGTERM", timeout)
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            logger.warning("engine core did not stop: SIGKILL")
            self._proc.kill()
            self._proc.join(5)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._sync_ctx.term()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
