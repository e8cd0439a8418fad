"""AsyncLLM: the engine as the API server sees it, one async stream of outputs per request.

The server process holds the Processor (validation, tokenisation) and the OutputProcessor
(detokenisation, stop strings, n > 1 fan-in); the EngineCore runs in its own process
(core_proc.py) and is reached through an EngineCoreClient (one core, or data-parallel
replicas: engine/client_factory.py), whose messages are engine/messages.py's Structs. A background task reads the core's
outputs, detokenises them and feeds each request's asyncio queue. A stream that is closed
or cancelled before its request finished (the client went away) aborts the request in the
core, which frees its KV blocks at once. A beam search runs in the core (engine/beam_search.py)
and comes back as one ranked result (BeamSearchHandle), aborted the same way.

Failures: a request that made a core step fail gets RequestFailedError in its stream (the
others go on). When the core process dies every request in flight gets EngineDeadError, and
then either `on_engine_dead` is called (the server exits non-zero, for a supervisor to restart
it) or, with restart_engine_on_failure, a new core is started and serves the next requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncGenerator, Callable, Optional

from pagedllm.engine import messages as m
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchOutput, beam_params, check_beam_args, detokenize
from pagedllm.engine.client_factory import make_core_client
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.engine.llm_engine import eos_token_ids, load_tokenizer, make_requests
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.metrics import DEFAULT_METRICS_PREFIX, EngineMetrics, StatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.engine.async_llm")

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestFailedError"]


class AsyncLLM:
    def __init__(
        self,
        engine_args: EngineArgs,
        model_name: Optional[str] = None,
        max_waiting_requests: Optional[int] = None,
        log_level: str = "INFO",
        log_stats_interval: float = 5.0,
        restart_engine_on_failure: bool = False,
        metrics_prefix: str = DEFAULT_METRICS_PREFIX,
    ) -> None:
        self.config = engine_args.create_engine_config()
        model_dir = self.config.model_config.model
        self.model_name = model_name or model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.eos, self.extra_eos = eos_token_ids(model_dir, self.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.max_num_seqs = self.config.scheduler_config.max_num_seqs
        self.max_model_len = self.config.model_config.max_model_len
        lc = self.config.lora_config
        self.metrics = EngineMetrics(
            self.model_name, prefix=metrics_prefix, max_lora=lc.max_loras if lc is not None else None
        )
        self.stat_logger = StatLogger(self.metrics, log_stats_interval)
        self._log_level = log_level
        self.client: Optional[EngineCoreClient] = None
        self.processor: Optional[Processor] = None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.beam_searches: dict[str, float] = {}  # searches running in the core: id -> arrival time
        self.num_blocks = 0
        self.core_pid: Optional[int] = None
        self.errored: Optional[BaseException] = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.restart_engine_on_failure = restart_engine_on_failure
        self.on_engine_dead: Optional[Callable[[], None]] = None  # the core died, no restart
        self.num_restarts = 0
        self._restart_task: Optional[asyncio.Task] = None

    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        self = cls(engine_args, **kwargs)
        await self.start()
        return self

    async def start(self, timeout: float = 900.0) -> None:
        eos_ids = ({self.eos} if self.eos is not None else set()) | self.extra_eos
        self.client = make_core_client(self.config, eos_ids, self._log_level)
        try:
            ready = await self.client.wait_ready(timeout)
        except BaseException:
            self.client.shutdown(timeout=2)
            raise
        self.num_blocks = ready.num_blocks
        self.core_pid = ready.pid
        self.processor = Processor(
            self.config, self.tokenizer, self.eos, self.extra_eos, self.num_blocks, ready.kv_cache_config
        )
        self.metrics.kv_num_blocks.set(self.num_blocks)
        loop = asyncio.get_running_loop()
        for fd in self.client.sentinels():
            loop.add_reader(fd, self._on_core_exit)
        self._tasks = [
            loop.create_task(self._output_loop(), name="pagedllm-output-loop"),
            loop.create_task(self._log_loop(), name="pagedllm-stat-logger"),
        ]

    # ------------------------------------------------------------ state
    def check_health(self) -> None:
        if self.errored is not None:
            raise self.errored
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        if self.client is None or not self.client.is_alive():
            raise EngineDeadError("the engine core process is not running")

    def num_waiting_estimate(self, new_seqs: int = 0) -> int:
        """Sequences that would be waiting with `new_seqs` more: beyond max_num_seqs in flight,
        or (when the KV cache is the limit) as many as the core last reported waiting."""
        est = len(self.output_processor.states) + new_seqs - self.max_num_seqs
        core_waiting = self.metrics.core_stats["waiting"]
        if core_waiting:
            est = max(est, core_waiting + new_seqs)
        return max(est, 0)

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        kind: OutputKind = OutputKind.DELTA,
        arrival_time: Optional[float] = None,
        lora_request=None,
        priority: int = 0,
    ) -> "RequestStream":
        """Validate, tokenise and send one request to the core; returns its output stream
        (DELTA: only what is new each time; FINAL_ONLY: once, at the end). Raises ValueError
        (bad input), EngineOverloadedError or EngineDeadError before anything is queued."""
        self._check_admission(request_id, getattr(params, "num_samples", params.n))
        requests = make_requests(
            self.processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            kind,
            arrival_time,
            lora_request,
            priority,
        )
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        stream = RequestStream(self, request_id, q)
        try:
            self.client.add_requests([m.EngineCoreRequest.from_request(r) for r in requests])
        except BaseException:
            stream.close()
            raise
        self.metrics.add_prompt_tokens(requests[0].num_prompt_tokens)
        return stream

    def _check_admission(self, request_id: str, num_seqs: int) -> None:
        self.check_health()
        if self.max_waiting_requests is not None and self.num_waiting_estimate(num_seqs) > self.max_waiting_requests:
            self.metrics.rejected.labels(self.model_name, "overloaded").inc()
            raise EngineOverloadedError(
                f"The server is overloaded: more than {self.max_waiting_requests} requests are waiting "
                "(--max-waiting-requests). Please retry later."
            )
        if request_id in self.queues:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_beam_search(
        self,
        prompt: PromptType,
        width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> "BeamSearchHandle":
        """Validate, tokenise and start a beam search in the core; returns the handle whose
        result() is the ranked sequences. Raises ValueError (bad input), EngineOverloadedError
        or EngineDeadError before anything is sent."""
        check_beam_args(width, max_tokens, length_penalty)
        request_id = request_id or f"beam-{uuid.uuid4().hex}"
        self._check_admission(request_id, width)
        _, request = self.processor.process(
            request_id, prompt, beam_params(width, max_tokens), beam_width=width, priority=priority
        )
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        self.beam_searches[request_id] = request.arrival_time
        handle = BeamSearchHandle(self, request_id, q)
        try:
            self.client.add_beam_search(
                m.BeamSearchStart(
                    m.EngineCoreRequest.from_request(request),
                    width,
                    float(length_penalty),
                    None if ignore_eos else self.eos,
                )
            )
        except BaseException:
            del self.beam_searches[request_id]
            handle.close()
            raise
        self.metrics.add_prompt_tokens(request.num_prompt_tokens)
        return handle

    async def beam_search(
        self,
        prompt: PromptType,
        width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        request_id: Optional[str] = None,
    ) -> BeamSearchOutput:
        """The search's sequences, best first, with their text; cancelling it aborts the search."""
        handle = self.add_beam_search(prompt, width, max_tokens, length_penalty, ignore_eos, request_id)
        return await handle.result()

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        kind: OutputKind = OutputKind.DELTA,
        arrival_time: Optional[float] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """add_request + iterate; closing the generator early aborts the request."""
        stream = self.add_request(prompt, params, request_id, kind, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def release(self, request_id: str, queue: asyncio.Queue, abort: bool) -> None:
        """A stream or handle closes: drop its output queue (if still the one registered for
        the id) and, unless its request already finished, abort it."""
        if self.queues.get(request_id) is queue:
            del self.queues[request_id]
        if abort:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request here and end it in the core (its blocks go back at once)."""
        if request_id in self.beam_searches:
            del self.beam_searches[request_id]
            self.metrics.finish("abort", 0.0, None, None, 0, 0.0)
            self._send_abort([request_id])
            return
        now = time.time()
        states = [
            st
            for st in self.output_processor.states.values()
            if st.request_id == request_id or (st.parent is not None and st.parent.request_id == request_id)
        ]
        child_ids = self.output_processor.abort_requests([request_id])
        for st in states:
            self.metrics.finish("abort", st.stats.arrival_time, None, None, 0, now)
        if child_ids:
            self._send_abort(child_ids)
            logger.debug("aborted request %s (%d sequences)", request_id, len(child_ids))

    def _send_abort(self, ids: list[str]) -> None:
        if self.client is not None and self.client.dead is None and self.errored is None:
            try:
                self.client.abort_requests(ids)
            except EngineDeadError:
                pass

    def abort_all(self, reason: BaseException) -> None:
        """Shutdown: end every request in flight (their streams get `reason`)."""
        for rid, q in list(self.queues.items()):
            self.abort(rid)
            q.put_nowait(reason)

    def stop_accepting(self) -> None:
        """Shutdown begins: new requests get EngineDeadError (503), those in flight are aborted."""
        self._stopping = True
        self.abort_all(EngineDeadError("the server is shutting down"))

    async def get_core_stats(self, timeout: float = 5.0) -> dict:
        self.check_health()
        return (await self.client.get_stats(timeout)).as_dict()

    async def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Empty every core's prefix cache; False (nothing reset) while requests hold blocks."""
        self.check_health()
        done = await self.client.call_utility("reset_prefix_cache", timeout=timeout)
        return all(done) if isinstance(done, list) else bool(done)

    # ------------------------------------------------------------ outputs
    async def _output_loop(self) -> None:
        try:
            while True:
                self._process(await self.client.get_output())
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:  # the core said it is dying
            self._fail(e)
        except BaseException as e:  # a bug here must not leave requests hanging
            logger.exception("the output loop failed")
            self._fail(EngineDeadError(f"the output loop failed: {type(e).__name__}: {e}"))

    def _process(self, outs: m.EngineCoreOutputs) -> None:
        metrics = self.metrics
        if outs.scheduler_stats is not None:
            metrics.update_core_stats(outs.scheduler_stats.as_dict())
        for _rid, queue_time in outs.queue_times:
            metrics.queue_time.observe(queue_time)
        for b in outs.beam_results:
            self._beam_result(b.output, b.error)
        for f in outs.failed:
            self._request_failed(f.request_id, RequestFailedError([f.request_id], f.message, f.client_error))
        outputs = outs.outputs
        if not outputs:
            return
        now = time.time()
        states = self.output_processor.states
        seen = []
        num_gen = 0
        for o in outputs:
            st = states.get(o.req_id)
            if st is None:
                continue
            s = st.stats
            if o.new_token_ids:
                if s.first_token_time is None:
                    metrics.ttft.observe(max(now - s.arrival_time, 0.0))
                else:
                    metrics.itl.observe(max(now - s.last_token_time, 0.0))
                num_gen += len(o.new_token_ids)
            seen.append(st)
        if num_gen:
            metrics.add_generation_tokens(num_gen)
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            try:
                self.client.abort_requests(to_abort)
            except EngineDeadError:
                pass
        for st in seen:
            if st.finish_reason is not None:
                metrics.finish(
                    st.finish_reason,
                    st.stats.arrival_time,
                    st.stats.first_token_time,
                    st.stats.last_token_time,
                    len(st.output_token_ids),
                    now,
                )
        for ro in request_outputs:
            q = self.queues.get(ro.request_id)
            if q is not None:
                q.put_nowait(ro)

    def _request_failed(self, core_id: str, err: RequestFailedError) -> None:
        """A core step failed because of this request (a sibling of it, a beam search): it is
        ended, its siblings aborted, and its stream gets the error."""
        if core_id in self.beam_searches:
            arrival = self.beam_searches.pop(core_id)
            self.metrics.finish("abort", arrival, None, None, 0, time.time())
            request_id = core_id
        else:
            request_id = self.output_processor.user_request_id(core_id)
            if request_id is None:
                return  # aborted meanwhile
            self.abort(request_id)
        err.req_ids = [request_id]
        q = self.queues.get(request_id)
        if q is not None:
            q.put_nowait(err)

    def _beam_result(self, out: BeamSearchOutput, error: Optional[str]) -> None:
        arrival = self.beam_searches.pop(out.request_id, None)
        if arrival is None:
            return  # aborted meanwhile
        q = self.queues.get(out.request_id)
        if error is not None:
            self.metrics.finish("abort", arrival, None, None, 0, time.time())
            item = RuntimeError(f"the engine core refused the beam search: {error}")
        else:
            self.metrics.add_generation_tokens(sum(len(h.tokens) for h in out.sequences))
            self.metrics.finish("stop", arrival, None, None, 0, time.time())
            item = detokenize(self.tokenizer, out)
        if q is not None:
            q.put_nowait(item)

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stat_logger.interval)
            try:
                self.stat_logger.log()
            except Exception:  # pragma: no cover
                logger.exception("stats logging failed")

    # ------------------------------------------------------------ failure / stop
    def _on_core_exit(self) -> None:
        loop = asyncio.get_running_loop()
        self._unwatch(self.client)
        if self._stopping:
            return
        code = self.client.exit_code
        logger.error("the engine core process died (exit code %s): the requests in flight get 503", code)
        self._fail(EngineDeadError(f"the engine core process died (exit code {code})"))
        if self.restart_engine_on_failure:
            self._restart_task = loop.create_task(self._restart(), name="pagedllm-core-restart")
        elif self.on_engine_dead is not None:
            self.on_engine_dead()

    @staticmethod
    def _unwatch(client: EngineCoreClient) -> None:
        loop = asyncio.get_running_loop()
        for fd in client.sentinels():
            loop.remove_reader(fd)

    async def _restart(self) -> None:
        """A new core in place of the dead one (every request gets 503 until it is ready)."""
        self.num_restarts += 1
        logger.warning("restarting the engine core (--restart-engine-on-failure; restart %d)", self.num_restarts)
        old = self.client
        await asyncio.get_running_loop().run_in_executor(None, old.shutdown, 2.0)
        try:
            await self.start()
            self.metrics.update_core_stats((await self.client.get_stats()).as_dict())
        except Exception as e:
            logger.error("the engine core could not be restarted: %s", e)
            if self.on_engine_dead is not None:
                self.on_engine_dead()
            return
        self.errored = None
        logger.info("the engine core is back (pid %s)", self.core_pid)

    def _fail(self, err: EngineDeadError) -> None:
        if self.errored is None:
            self.errored = err
        if self.client is not None:
            self.client.mark_dead(err)
        for rid, q in list(self.queues.items()):
            self.output_processor.abort_requests([rid])
            q.put_nowait(err)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def shutdown(self) -> None:
        """Abort what is in flight and stop the core process (idempotent)."""
        if self._stopping and self.client is None:
            return
        self.stop_accepting()
        await asyncio.sleep(0)  # let the streams see it
        for t in [*self._tasks, self._restart_task]:
            if t is not None:
                t.cancel()
        if self.client is not None:
            self._unwatch(self.client)
            client, self.client = self.client, None
            await asyncio.get_running_loop().run_in_executor(None, client.shutdown)


class _Handle:
    """A request's queue held by the caller. close() releases it, aborting the request in the
    core if it is still running; dropping the handle unclosed does the same (a response
    cancelled before it began reading must not leak blocks or queue entries)."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue = queue
        self.closed = False

    def _abort_on_close(self) -> bool:
        return True

    def __del__(self) -> None:
        try:  # safety net
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.release(self.request_id, self.queue, abort=self._abort_on_close())


class BeamSearchHandle(_Handle):
    """One beam search in flight: result() waits for its ranked sequences. close() (or a
    cancellation while waiting) before the result came aborts the search in the core (after
    it, the abort is a no-op)."""

    async def result(self) -> BeamSearchOutput:
        if self.closed:
            raise RuntimeError(f"beam search {self.request_id!r} is closed")
        try:
            item = await self.queue.get()
        finally:
            self.close()
        if isinstance(item, BaseException):
            raise item
        return item


class RequestStream(_Handle):
    """The outputs of one request, as an async iterator. close() (or a cancellation while
    waiting) before the request finished aborts it in the core."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        super().__init__(engine, request_id, queue)
        self.finished = False

    def _abort_on_close(self) -> bool:
        return not self.finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled: the client went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item
