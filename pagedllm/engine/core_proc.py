"""The EngineCore process: the scheduler, the KV cache and the model runner in a busy loop.

    loop { take every waiting message (add / beam / abort / utility / shutdown) -> step while
           there is work -> push the step's EngineCoreOutputs and the scheduler's stats }

It knows nothing of text or HTTP: requests arrive tokenised (the server's Processor) and
outputs leave as token ids (the server's OutputProcessor detokenises them). Beam searches run
here (a BeamSearchDriver fed each step's outputs), so that choosing and forking beams costs
no round trip to the server; only each search's ranked result leaves. A step that fails
because of a request ends that request alone (engine/step_failures.py) and says so in the
step's message (`failed`); the loop goes on. Messages are
engine/messages.py's Structs; a frame that is none ends the process with an error message
(the server's requests then fail, they do not hang). The process ends on a shutdown message, on SIGTERM, or when its
parent dies (PR_SET_PDEATHSIG, and a parent check while idle), so it is never left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import zmq

from pagedllm.engine import messages as m
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.beam_search import BeamSearchDriver, BeamSearchOutput
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.gc_heap import freeze_gc_heap
from pagedllm.lora.request import count_adapters
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger("pagedllm.engine.core_proc")

IDLE_POLL_MS = 500


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent process dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - best effort
        pass


class _Stop(Exception):
    pass


def run_engine_core(
    config, eos_ids, input_addr: str, output_addr: str, parent_pid: int, log_level: str = "INFO"
) -> None:
    """Entry point of the core process (multiprocessing, spawn)."""
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(log_level.upper())  # not torch's chatter
    # Ctrl-C reaches the whole process group: the server decides and tells us to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, on_term)

    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    code = 0
    core = None
    try:
        try:
            from pagedllm.engine.core import EngineCore

            core = EngineCore(config, eos_ids=set(eos_ids))
        except _Stop:
            raise
        except BaseException as e:
            if not isinstance(e, ValueError):  # a ValueError is a bad setting, said in one line by the server
                logger.error("the engine core failed to start:\n%s", traceback.format_exc())
            out_sock.send(m.encode_output(m.EngineCoreError(type(e).__name__, str(e))))
            code = 1
        if core is not None:
            freeze_gc_heap("engine core")
            out_sock.send(m.encode_output(m.EngineCoreReady(core.num_blocks, os.getpid(), core.kv_cache_config)))
            EngineCoreProc(core, in_sock, out_sock, parent_pid).run()
    except _Stop:
        logger.info("engine core: SIGTERM, exiting")
    except BaseException as e:
        logger.error("the engine core died:\n%s", traceback.format_exc())
        try:
            out_sock.send(m.encode_output(m.EngineCoreError(type(e).__name__, str(e))), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()  # the worker processes of a split model, if any
            except Exception:
                logger.exception("engine core: shutdown of its workers failed")
        in_sock.close(linger=0)
        out_sock.close()
        ctx.term()
    if code:
        sys.exit(code)


class EngineCoreProc:
    def __init__(self, core, in_sock, out_sock, parent_pid: int) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.scheduler = core.scheduler
        self.beams = BeamSearchDriver(core)
        self.num_added = 0
        # Requests not yet scheduled once: their queue time is reported when they are.
        self.unscheduled: dict[str, Request] = {}
        self.stop = False
        self.handlers = {
            m.AddRequests: self.add_requests,
            m.BeamSearchStart: self.add_beam_search,
            m.AbortRequests: self.abort,
            m.UtilityRequest: self.call_utility,
            m.Shutdown: self.shutdown,
        }

    # ------------------------------------------------------------ stats
    def stats(self) -> m.SchedulerStats:
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        return m.SchedulerStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage=pool.get_usage(),
            used_blocks=(pool.num_blocks - 1) - pool.get_num_free_blocks(),
            num_blocks=pool.num_blocks,
            preemptions=s.num_preemptions,
            num_added=self.num_added,
            prefix_cache_queries=s.kv_cache_manager.stats.queries,
            prefix_cache_hits=s.kv_cache_manager.stats.hits,
            mm_cache_queries=s.mm_cache_queries,
            mm_cache_hits=s.mm_cache_hits,
            running_lora_adapters=count_adapters(s.running),
            waiting_lora_adapters=count_adapters(s.waiting),
            spec_decoding=s.spec_decoding_stats.as_dict() if s.spec_decoding_stats.num_drafts else None,
        )

    def _send(self, msg: m.CoreOutput) -> None:
        self.out_sock.send(m.encode_output(msg))

    # ------------------------------------------------------------ input
    def handle(self, msg: m.CoreRequest) -> None:
        self.handlers[type(msg)](msg)

    def add_requests(self, msg: m.AddRequests) -> None:
        rejected = []
        for enc in msg.requests:
            self.num_added += 1
            req = enc.to_request()
            try:
                self.core.add_request(req)
            except ValueError as e:  # e.g. a duplicate id: end it, keep the engine running
                logger.warning("request %s rejected by the core: %s", req.request_id, e)
                rejected.append(_aborted(req.request_id))
                continue
            self.unscheduled[req.request_id] = req
        if rejected:
            self._send(m.EngineCoreOutputs(rejected, self.stats()))

    def add_beam_search(self, msg: m.BeamSearchStart) -> None:
        self.num_added += 1
        req = msg.request.to_request()
        search_id = req.request_id
        try:
            self.beams.add(req, msg.width, msg.length_penalty, msg.eos_token_id)
        except ValueError as e:  # e.g. a duplicate id: answer it, keep the engine running
            logger.warning("beam search %s rejected by the core: %s", search_id, e)
            refused = BeamSearchOutput(req.prompt_token_ids, [], search_id)
            self._send(m.EngineCoreOutputs(scheduler_stats=self.stats(), beam_results=[m.BeamResult(refused, str(e))]))
            return
        self.unscheduled[req.request_id] = req  # the first beam: its queue time is the search's

    def abort(self, msg: m.AbortRequests) -> None:
        ids = msg.request_ids
        for rid in ids:
            self.beams.abort(rid)
        self.core.abort_requests(ids)
        for rid in ids:
            self.unscheduled.pop(rid, None)

    def call_utility(self, msg: m.UtilityRequest) -> None:
        try:
            result, err = self.utility(msg.method, msg.args), None
        except Exception as e:  # report to the caller, keep running
            result, err = None, f"{type(e).__name__}: {e}"
        self._send(m.UtilityOutput(msg.call_id, result, err))

    def shutdown(self, msg: m.Shutdown) -> None:
        self.stop = True

    def utility(self, method: str, args: list):
        if method == "get_stats":
            return self.stats()
        if method == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        if method == "ping":
            return "pong"
        raise ValueError(f"unknown utility method {method!r}")

    def drain(self) -> bool:
        handled = False
        while True:
            try:
                frames = self.in_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            self.handle(m.decode_request(frames))
            handled = True

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        while not self.stop:
            busy = self.core.has_unfinished_requests()
            handled = False
            if busy:
                handled = self.drain()
            elif poller.poll(IDLE_POLL_MS):
                handled = self.drain()
            elif os.getppid() != self.parent_pid:
                logger.warning("engine core: the server process is gone, exiting")
                return
            if self.stop:
                break
            if self.core.has_unfinished_requests():
                t0 = time.time()
                try:
                    outputs = self.core.step()
                except RequestFailedError as e:
                    self._send_failures(e, t0)
                    continue
                # The beams' outputs feed their searches; only ended searches go out.
                others = [o for o in outputs if not self.beams.owns(o.req_id)]
                ended = self.beams.on_outputs(outputs) if len(others) < len(outputs) else []
                self._send(
                    m.EngineCoreOutputs(others, self.stats(), self._queue_events(t0), [m.BeamResult(b) for b in ended])
                )
            elif handled:
                self._send(m.EngineCoreOutputs(scheduler_stats=self.stats()))

    def _send_failures(self, e: RequestFailedError, t0: float) -> None:
        """The requests a failed step convicted, by the ids the server knows (a beam's
        search: the whole search ends)."""
        failed = []
        for rid in e.req_ids:
            search = self.beams.by_req.get(rid)
            if search is not None:
                rid = search.request_id
                self.beams.abort(rid)
            if rid not in failed:
                failed.append(rid)
        self._send(
            m.EngineCoreOutputs(
                scheduler_stats=self.stats(),
                queue_times=self._queue_events(t0),
                failed=[m.FailedRequest(rid, str(e), e.client_error) for rid in failed],
            )
        )

    def _queue_events(self, t0: float) -> list[tuple[str, float]]:
        events = []
        for rid, req in list(self.unscheduled.items()):
            if req.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM):
                continue
            del self.unscheduled[rid]
            if req.status != RequestStatus.FINISHED_ABORTED:
                events.append((rid, max(t0 - req.arrival_time, 0.0)))
        return events


def _aborted(req_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(req_id=req_id, new_token_ids=[], finish_reason="abort")
