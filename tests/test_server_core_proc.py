"""The engine-core process loop and its messages, without a model (milliseconds): the msgpack
encoding round-trips every type that crosses the boundary, and EngineCoreProc, driven over
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
from pagedllm.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput
from pagedllm.engine import serial
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSequence, beam_params
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.step_failures import StepFailures
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

TOKEN = 1000
POISON = 666   # a step with a request whose prompt holds it raises


def test_serial_round_trip():
    sp = SamplingParams(n=2, best_of=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                        presence_penalty=0.5, frequency_penalty=-0.5, seed=2 ** 62, max_tokens=7, min_tokens=2,
                        stop=["a", "bc"], stop_token_ids=[3, 4], include_stop_str_in_output=True, ignore_eos=True,
                        logprobs=3, skip_special_tokens=False, logit_bias={5: -100.0, 7: 2.5})
    sp.all_stop_token_ids = {3, 4, 9}
    back = serial.decode_sampling_params(serial.unpack(serial.pack(serial.encode_sampling_params(sp))))
    assert back == sp and back.all_stop_token_ids == {3, 4, 9} and back.logit_bias == {5: -100.0, 7: 2.5}

    req = Request("r-1", [1, 2, 3], sp, eos_token_id=2, arrival_time=123.5)
    req.max_tokens = 9
    req.extra_keys = ("lora", 3)
    back = serial.decode_request(serial.unpack(serial.pack(serial.encode_request(req))))
    assert (back.request_id, back.prompt_token_ids, back.eos_token_id, back.arrival_time, back.max_tokens,
            back.extra_keys) == ("r-1", [1, 2, 3], 2, 123.5, 9, ("lora", 3))
    assert back.sampling_params == sp and back.num_computed_tokens == 0

    out = EngineCoreOutput("r-1", [5, 6], "stop", "bc", [([5, 7], [-0.1, -2.0], 1), ([6], [-0.5], 2)], 4)
    assert serial.decode_output(serial.unpack(serial.pack(serial.encode_output(out)))) == out

    beams = BeamSearchOutput([1, 2], [BeamSequence([5, 2], -0.5, -0.25, finish_reason="stop"),
                                      BeamSequence([6, 7], -0.9, -0.45)], "r-2", 16)
    back = serial.decode_beam_output(serial.unpack(serial.pack(serial.encode_beam_output(beams))))
    assert back == (beams, None)


class FakeRunner:
    """One token (TOKEN) for each request whose step reaches its last known token; asked for
    logprobs, it ranks TOKEN, TOKEN + 1, ... at -0.5, -1.0, ...; raises in a step with POISON."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def reset(self) -> None:   # no rows to forget
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
            logprobs.append(None if k is None else ([TOKEN] + [TOKEN + j for j in range(k)],
                                                    [-0.5] + [-0.5 * (j + 1) for j in range(k)], 1))
        time.sleep(0.002)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)


def _fake_core(num_blocks=64, block_size=4) -> EngineCore:
    core = EngineCore.__new__(EngineCore)
    core.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256),
                               KVCacheManager(num_blocks, block_size))
    core.model_executor = FakeRunner(core.scheduler)
    core.failures = StepFailures(core.scheduler, core.model_executor)
    core.num_blocks = num_blocks
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
        to_core.send(serial.pack(msg))

    def recv(timeout_ms=5000):
        assert from_core.poll(timeout_ms), "no message from the core"
        return serial.unpack(from_core.recv())

    yield p, send, recv
    send({"t": "shutdown"})
    t.join(5)
    assert not t.is_alive()
    for s in (to_core, from_core, core_in, core_out):
        s.close(linger=0)
    ctx.term()


def _req(rid, n_prompt, max_tokens, first=10):
    r = Request(rid, list(range(first, first + n_prompt)), SamplingParams(temperature=0, max_tokens=max_tokens),
                eos_token_id=2, arrival_time=time.time())
    r.max_tokens = max_tokens
    return serial.encode_request(r)


@pytest.mark.timeout(30)
def test_core_proc_add_step_abort_utility(proc):
    p, send, recv = proc
    send({"t": "add", "r": [_req("a", 5, 3), _req("b", 9, 200)]})
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    queued = set()
    while "a" not in finished:
        msg = recv()
        assert msg["t"] == "out", msg
        assert set(msg["s"]) >= {"running", "waiting", "kv_usage", "used_blocks", "num_blocks", "preemptions"}
        queued |= {rid for rid, qt in msg["q"] if qt >= 0}
        for o in map(serial.decode_output, msg["o"]):
            got[o.req_id] += o.new_token_ids
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    assert got["a"] == [TOKEN] * 3 and finished["a"] == "length"
    assert queued == {"a", "b"}
    # a utility call is answered between steps
    send({"t": "util", "id": 7, "m": "get_stats", "a": []})
    send({"t": "util", "id": 8, "m": "nope", "a": []})
    replies = {}
    while len(replies) < 2:
        msg = recv()
        if msg["t"] == "util":
            replies[msg["id"]] = msg
    assert replies[7]["e"] is None and replies[7]["r"]["running"] == 1 and replies[7]["r"]["used_blocks"] > 0
    assert "unknown utility" in replies[8]["e"]
    # abort b: its blocks come back, and a stats message says so once the core is idle
    send({"t": "abort", "ids": ["b"]})
    deadline = time.time() + 60   # generous: a loaded machine is slow, not wrong
    while True:
        msg = recv()
        if msg["t"] == "stats":
            break
        assert time.time() < deadline
    assert msg["s"]["used_blocks"] == 0 and msg["s"]["running"] == 0 and msg["s"]["kv_usage"] == 0
    assert p.scheduler.kv_cache_manager.num_free_blocks() == p.core.num_blocks - 1


@pytest.mark.timeout(30)
def test_core_proc_duplicate_id_is_rejected_not_fatal(proc):
    p, send, recv = proc
    send({"t": "add", "r": [_req("x", 3, 50)]})
    send({"t": "add", "r": [_req("x", 3, 2)]})  # same id: ended at once, the engine goes on
    aborted = False
    while not aborted:
        msg = recv()
        for o in map(serial.decode_output, msg.get("o", [])):
            if o.req_id == "x" and o.finish_reason == "abort":
                aborted = True
    send({"t": "util", "id": 1, "m": "ping", "a": []})
    while True:
        msg = recv()
        if msg["t"] == "util":
            assert msg["r"] == "pong"
            break


def _beam_req(rid, n_prompt, width, max_tokens, first=10):
    r = Request(rid, list(range(first, first + n_prompt)), beam_params(width, max_tokens), eos_token_id=2,
                arrival_time=time.time())
    r.max_tokens = max_tokens
    return serial.encode_request(r)


@pytest.mark.timeout(30)
def test_core_proc_beam_search(proc):
    """A search runs interleaved with a normal request; only its ranked result leaves the core;
    an aborted search frees its beams' blocks."""
    p, send, recv = proc
    send({"t": "add", "r": [_req("a", 5, 6)]})
    send({"t": "beam", "r": _beam_req("s", 6, 2, 4), "w": 2, "lp": 1.0, "eos": None})
    send({"t": "beam", "r": _beam_req("t", 6, 2, 100), "w": 2, "lp": 1.0, "eos": None})   # 2 x 27 of 63 blocks
    got, results, n_msgs = [], {}, 0
    while "s" not in results or len(got) < 6:
        msg = recv()
        n_msgs += 1
        if n_msgs == 3:
            send({"t": "abort", "ids": ["t"]})
        outs = [serial.decode_output(o) for o in msg.get("o", [])]
        assert {o.req_id for o in outs} <= {"a"}, outs   # the beams' outputs stay in the core
        got += [t for o in outs for t in o.new_token_ids]
        for enc in msg.get("b", []):
            out, err = serial.decode_beam_output(enc)
            assert err is None
            results[out.request_id] = out
    assert got == [TOKEN] * 6
    # Each beam ranks TOKEN + j at -0.5 (j + 1): the two best 4-token hypotheses.
    assert [h.tokens for h in results["s"].sequences] == [[TOKEN] * 4, [TOKEN] * 3 + [TOKEN + 1]]
    assert [h.score for h in results["s"].sequences] == [-2.0 / 4, -2.5 / 4]
    assert results["s"].prompt_token_ids == list(range(10, 16)) and "t" not in results
    # The aborted search ends silently and its blocks come back.
    deadline = time.time() + 60   # generous: a loaded machine is slow, not wrong
    while True:
        send({"t": "util", "id": 0, "m": "get_stats", "a": []})
        msg = recv()
        while msg["t"] != "util":
            assert not msg.get("b"), "the aborted search must not report"
            msg = recv()
        if msg["r"]["running"] == 0:
            break
        assert time.time() < deadline
    assert msg["r"]["used_blocks"] == 0 and not p.beams.has_searches()
    # A duplicate search id is answered with an error, not fatal.
    send({"t": "beam", "r": _beam_req("u", 3, 2, 50), "w": 2, "lp": 1.0, "eos": None})
    send({"t": "beam", "r": _beam_req("u", 3, 2, 50), "w": 2, "lp": 1.0, "eos": None})
    errors = []
    while not errors:
        errors = [e for e in (serial.decode_beam_output(b)[1] for b in recv().get("b", [])) if e]
    assert "already in use" in errors[0]
    send({"t": "abort", "ids": ["u"]})


@pytest.mark.timeout(30)
def test_core_proc_failed_step_ends_only_its_culprit(proc):
    """Poisoned requests (a plain one, a beam search) batched with innocent ones: each poisoned
    one is reported failed ("f"), alone; the innocent ones get every token once; no block leaks."""
    p, send, recv = proc
    send({"t": "add", "r": [_req("a", 5, 12), _req("b", 9, 12)]})
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished, failed = {}, {}
    n_msgs = 0
    while len(finished) < 2 or len(failed) < 2:
        msg = recv()
        n_msgs += 1
        if n_msgs == 1:   # a and b are running
            send({"t": "add", "r": [_req("x", 4, 12, first=POISON)]})
            send({"t": "beam", "r": _beam_req("s", 3, 2, 8, first=POISON - 1), "w": 2, "lp": 1.0, "eos": None})
        assert not msg.get("b"), msg
        for rid, message, client_error in msg.get("f", []):
            failed[rid] = (message, client_error)
        for o in map(serial.decode_output, msg.get("o", [])):
            assert o.req_id in got, o
            got[o.req_id] += o.new_token_ids
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
    assert set(failed) == {"x", "s"}
    assert all("RuntimeError: poisoned" in m and not client for m, client in failed.values()), failed
    assert got["a"] == got["b"] == [TOKEN] * 12 and finished == {"a": "length", "b": "length"}
    send({"t": "util", "id": 3, "m": "get_stats", "a": []})
    msg = recv()
    while msg["t"] != "util":
        msg = recv()
    assert msg["r"]["used_blocks"] == 0 and msg["r"]["running"] == msg["r"]["waiting"] == 0
    assert not p.beams.has_searches() and not p.core.failures.suspects
