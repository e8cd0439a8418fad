"""The engine-core process loop and its messages, without a model (milliseconds): EngineCoreProc, driven over
real ZMQ sockets with a real scheduler and a fake model runner, handles add / beam / abort /
utility / shutdown, reports stats and queue times, frees an aborted request's blocks, and
ends only the culprit of a step that raises."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.engine import messages as m
from pagedllm.engine.beam_search import beam_params
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.step_failures import StepFailures
from pagedllm.request import Request
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.sampling_params import SamplingParams

TOKEN = 1000
POISON = 666  # a step with a request whose prompt holds it raises


class FakeRunner:
    """One token (TOKEN) for each request whose step reaches its last known token; asked for
    logprobs, it ranks TOKEN, TOKEN + 1, ... at -0.5, -1.0, ...; raises in a step with POISON."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def reset(self) -> None:  # no rows to forget
        pass

    def execute_model(self, so):
        req_ids = list(so.num_scheduled_tokens)
        if any(POISON in self.scheduler.requests[rid].prompt_token_ids for rid in req_ids):
            raise RuntimeError("poisoned")
        sampled, logprobs = [], []
        for rid in req_ids:
            r = self.scheduler.requests[rid]
            sampled.append([TOKEN] if r.num_computed_tokens >= r.num_tokens else [])
            k = r.sampling_params.logprobs
            logprobs.append(
                None
                if k is None
                else [([TOKEN] + [TOKEN + j for j in range(k)], [-0.5] + [-0.5 * (j + 1) for j in range(k)], 1)]
            )
        time.sleep(0.002)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)


def _fake_core(num_blocks=64, block_size=4) -> EngineCore:
    core = EngineCore.__new__(EngineCore)
    core.scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256),
        KVCacheManager(num_blocks, block_size),
    )
    core.model_executor = FakeRunner(core.scheduler)
    core.failures = StepFailures(core.scheduler, core.model_executor)
    core.num_blocks = num_blocks
    # No request here is constrained: the manager is never asked to compile (no tokenizer needed).
    core.structured_output_manager = StructuredOutputManager("", vocab_size=1000, stop_token_ids=set())
    return core


@pytest.fixture
def proc(tmp_path):
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind(f"ipc://{tmp_path}/in")
    from_core.bind(f"ipc://{tmp_path}/out")
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.connect(f"ipc://{tmp_path}/in")
    core_out.connect(f"ipc://{tmp_path}/out")
    import os

    p = EngineCoreProc(_fake_core(), core_in, core_out, os.getppid())
    t = threading.Thread(target=p.run, daemon=True)
    t.start()

    def send(msg):
        to_core.send_multipart(m.encode_request(msg))

    def recv(timeout_ms=5000):
        assert from_core.poll(timeout_ms), "no message from the core"
        return m.decode_output(from_core.recv())

    yield p, send, recv
    send(m.Shutdown())
    t.join(5)
    assert not t.is_alive()
    for s in (to_core, from_core, core_in, core_out):
        s.close(linger=0)
    ctx.term()


def _req(rid, n_prompt, max_tokens, first=10):
    r = Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
        eos_token_id=2,
        arrival_time=time.time(),
    )
    r.max_tokens = max_tokens
    return m.EngineCoreRequest.from_request(r)


@pytest.mark.timeout(30)
def test_core_proc_add_step_abort_utility(proc):
    p, send, recv = proc
    send(m.AddRequests([_req("a", 5, 3), _req("b", 9, 200)]))
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    queued = set()
    while "a" not in finished:
        msg = recv()
        assert isinstance(msg, m.EngineCoreOutputs) and msg.scheduler_stats is not None, msg
        queued |= {rid for rid, qt in msg.queue_times if qt >= 0}
        for o in msg.outputs:
            got[o.req_id] += o.new_token_ids
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    assert got["a"] == [TOKEN] * 3 and finished["a"] == "length"
    assert queued == {"a", "b"}
    # a utility call is answered between steps
    send(m.UtilityRequest(7, "get_stats"))
    send(m.UtilityRequest(8, "nope"))
    replies = {}
    while len(replies) < 2:
        msg = recv()
        if isinstance(msg, m.UtilityOutput):
            replies[msg.call_id] = msg
    assert replies[7].error is None and replies[7].result["running"] == 1 and replies[7].result["used_blocks"] > 0
    assert "unknown utility" in replies[8].error
    # abort b: its blocks come back, and a stats message says so once the core is idle
    send(m.AbortRequests(["b"]))
    deadline = time.time() + 60  # generous: a loaded machine is slow, not wrong
    while True:
        stats = recv().scheduler_stats
        if stats.running == 0:
            break
        assert time.time() < deadline
    assert stats.used_blocks == 0 and stats.kv_usage == 0
    assert p.scheduler.kv_cache_manager.num_free_blocks() == p.core.num_blocks - 1


@pytest.mark.timeout(30)
def test_core_proc_duplicate_id_is_rejected_not_fatal(proc):
    p, send, recv = proc
    send(m.AddRequests([_req("x", 3, 50)]))
    send(m.AddRequests([_req("x", 3, 2)]))  # same id: ended at once, the engine goes on
    aborted = False
    while not aborted:
        for o in recv().outputs:
            if o.req_id == "x" and o.finish_reason == "abort":
                aborted = True
    send(m.UtilityRequest(1, "ping"))
    while True:
        msg = recv()
        if isinstance(msg, m.UtilityOutput):
            assert msg.result == "pong"
            break


def _beam_req(rid, n_prompt, width, max_tokens, first=10):
    r = Request(
        rid,
        list(range(first, first + n_prompt)),
        beam_params(width, max_tokens),
        eos_token_id=2,
        arrival_time=time.time(),
    )
    r.max_tokens = max_tokens
    return m.BeamSearchStart(m.EngineCoreRequest.from_request(r), width, 1.0, None)


@pytest.mark.timeout(30)
def test_core_proc_beam_search(proc):
    """A search runs interleaved with a normal request; only its ranked result leaves the core;
    an aborted search frees its beams' blocks."""
    p, send, recv = proc
    send(m.AddRequests([_req("a", 5, 6)]))
    send(_beam_req("s", 6, 2, 4))
    send(_beam_req("t", 6, 2, 100))  # 2 x 27 of 63 blocks
    got, results, n_msgs = [], {}, 0
    while "s" not in results or len(got) < 6:
        msg = recv()
        n_msgs += 1
        if n_msgs == 3:
            send(m.AbortRequests(["t"]))
        outs = msg.outputs
        assert {o.req_id for o in outs} <= {"a"}, outs  # the beams' outputs stay in the core
        got += [t for o in outs for t in o.new_token_ids]
        for b in msg.beam_results:
            assert b.error is None
            results[b.output.request_id] = b.output
    assert got == [TOKEN] * 6
    # Each beam ranks TOKEN + j at -0.5 (j + 1): the two best 4-token hypotheses.
    assert [h.tokens for h in results["s"].sequences] == [[TOKEN] * 4, [TOKEN] * 3 + [TOKEN + 1]]
    assert [h.score for h in results["s"].sequences] == [-2.0 / 4, -2.5 / 4]
    assert results["s"].prompt_token_ids == list(range(10, 16)) and "t" not in results
    # The aborted search ends silently and its blocks come back.
    deadline = time.time() + 60  # generous: a loaded machine is slow, not wrong
    while True:
        send(m.UtilityRequest(0, "get_stats"))
        msg = recv()
        while not isinstance(msg, m.UtilityOutput):
            assert not msg.beam_results, "the aborted search must not report"
            msg = recv()
        if msg.result["running"] == 0:
            break
        assert time.time() < deadline
    assert msg.result["used_blocks"] == 0 and not p.beams.has_searches()
    # A duplicate search id is answered with an error, not fatal.
    send(_beam_req("u", 3, 2, 50))
    send(_beam_req("u", 3, 2, 50))
    errors = []
    while not errors:
        msg = recv()
        errors = [b.error for b in getattr(msg, "beam_results", ()) if b.error]
    assert "already in use" in errors[0]
    send(m.AbortRequests(["u"]))


@pytest.mark.timeout(30)
def test_core_proc_failed_step_ends_only_its_culprit(proc):
    """Poisoned requests (a plain one, a beam search) batched with innocent ones: each poisoned
    one is reported failed ("f"), alone; the innocent ones get every token once; no block leaks."""
    p, send, recv = proc
    send(m.AddRequests([_req("a", 5, 12), _req("b", 9, 12)]))
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished, failed = {}, {}
    n_msgs = 0
    while len(finished) < 2 or len(failed) < 2:
        msg = recv()
        n_msgs += 1
        if n_msgs == 1:  # a and b are running
            send(m.AddRequests([_req("x", 4, 12, first=POISON)]))
            send(_beam_req("s", 3, 2, 8, first=POISON - 1))
        assert not msg.beam_results, msg
        for f in msg.failed:
            failed[f.request_id] = (f.message, f.client_error)
        for o in msg.outputs:
            assert o.req_id in got, o
            got[o.req_id] += o.new_token_ids
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    assert set(failed) == {"x", "s"}
    assert all("RuntimeError: poisoned" in m and not client for m, client in failed.values()), failed
    assert got["a"] == got["b"] == [TOKEN] * 12 and finished == {"a": "length", "b": "length"}
    send(m.UtilityRequest(3, "get_stats"))
    msg = recv()
    while not isinstance(msg, m.UtilityOutput):
        msg = recv()
    assert msg.result["used_blocks"] == 0 and msg.result["running"] == msg.result["waiting"] == 0
    assert not p.beams.has_searches() and not p.core.failures.suspects
