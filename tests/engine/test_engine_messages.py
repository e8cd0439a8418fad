"""The messages between the API server and the engine core (engine/messages.py): every type
round-trips through its frames unchanged (logit_bias keeps int keys, the engine's stop ids and
nested extra keys survive), a frame that is not a message is a clear ProtocolError, and the
offline engine never imports msgspec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.core.kv_cache_utils import make_kv_cache_config
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine import messages as m
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSequence
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def _request() -> m.EngineCoreRequest:
    sp = SamplingParams(
        n=2,
        best_of=3,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=2**62,
        max_tokens=7,
        min_tokens=2,
        stop=["a", "bc"],
        stop_token_ids=[3, 4],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
        logit_bias={5: -100.0, 7: 2.5},
    )
    sp.all_stop_token_ids = {3, 4, 9}  # the engine's EOS extras, beyond the user's stop_token_ids
    req = Request("r-1", [1, 2, 3], sp, eos_token_id=2, arrival_time=123.5)
    req.max_tokens = 9
    req.extra_keys = ("lora", 3, ("nested", 1))
    return m.EngineCoreRequest.from_request(req)


def _stats(**kw) -> m.SchedulerStats:
    return m.SchedulerStats(
        **{
            "running": 1,
            "waiting": 2,
            "kv_usage": 0.25,
            "used_blocks": 4,
            "num_blocks": 16,
            "preemptions": 0,
            "num_added": 3,
            **kw,
        }
    )


REQUESTS = [
    m.AddRequests([_request()]),
    m.BeamSearchStart(_request(), width=4, length_penalty=0.5, eos_token_id=None),
    m.AbortRequests(["a", "0_b"]),
    m.UtilityRequest(7, "get_stats", []),
    m.UtilityRequest(8, "ping", [1, "x"]),
    m.Shutdown(),
]

_BEAMS = BeamSearchOutput(
    [1, 2],
    [BeamSequence([5, 2], -0.5, -0.25, finish_reason="stop", logprobs=[-0.2, -0.3]), BeamSequence([6, 7], -0.9, -0.45)],
    "r-2",
    16,
)
OUTPUTS = [
    m.EngineCoreReady(num_blocks=63, pid=1234, kv_cache_config=make_kv_cache_config([None, 4, 4, None, 4])),
    m.EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("r-1", [5, 6], "stop", "bc", [([5, 7], [-0.1, -2.0], 1), ([6], [-0.5], 2)], 4),
            EngineCoreOutput("0_r-3", [9], None, None, None, 0),
            EngineCoreOutput("r-4", [], "stop", 2),
        ],
        scheduler_stats=_stats(prefix_cache_queries=10, prefix_cache_hits=4),
        queue_times=[("r-1", 0.5)],
        beam_results=[m.BeamResult(_BEAMS), m.BeamResult(BeamSearchOutput([1], [], "r-5"), "already in use")],
        failed=[m.FailedRequest("r-6", "the engine failed running request 'r-6': boom", True)],
    ),
    m.EngineCoreOutputs(scheduler_stats=_stats()),  # an idle core's stats
    m.UtilityOutput(7, {"running": 1, "kv_usage": 0.5}),
    m.UtilityOutput(8, None, "ValueError: unknown utility method 'nope'"),
    m.EngineCoreError("RuntimeError", "CUDA out of memory"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda x: type(x).__name__)
def test_request_round_trip(msg):
    frames = m.encode_request(msg)
    assert len(frames) == 2 and isinstance(m.EngineCoreRequestType(frames[0]), m.EngineCoreRequestType)
    assert m.decode_request(frames) == msg


@pytest.mark.parametrize("msg", OUTPUTS, ids=lambda x: type(x).__name__)
def test_output_round_trip(msg):
    assert m.decode_output(m.encode_output(msg)) == msg


def test_engine_core_request_rebuilds_the_request():
    back = m.decode_request(m.encode_request(m.AddRequests([_request()]))).requests[0].to_request()
    sp = back.sampling_params
    assert (
        back.request_id,
        back.prompt_token_ids,
        back.eos_token_id,
        back.arrival_time,
        back.max_tokens,
        back.extra_keys,
    ) == ("r-1", [1, 2, 3], 2, 123.5, 9, ("lora", 3, ("nested", 1)))
    assert sp.logit_bias == {5: -100.0, 7: 2.5} and all(type(k) is int for k in sp.logit_bias)
    assert sp.all_stop_token_ids == {3, 4, 9} and sp.stop == ["a", "bc"] and sp.seed == 2**62
    assert back.num_computed_tokens == 0 and back.output_token_ids == []


def test_scheduler_stats_as_dict():
    merged = _stats(replicas=[_stats(), None], router_loads=[1, 0])
    d = merged.as_dict()
    assert d["replicas"][0]["used_blocks"] == 4 and d["replicas"][1] is None and d["router_loads"] == [1, 0]
    assert "replicas" not in _stats().as_dict()


@pytest.mark.parametrize(
    "frames, error",
    [
        ([b"\x7f", b"\x90"], "unknown engine core request type"),
        ([b"add", b"\x90"], "unknown engine core request type"),
        ([m.EngineCoreRequestType.ABORT.value], "2 frames"),
        ([m.EngineCoreRequestType.ABORT.value, b"\xc1"], "garbled AbortRequests"),
        ([m.EngineCoreRequestType.ADD.value, m.encode_request(m.AbortRequests(["a"]))[1]], "garbled AddRequests"),
        # a SamplingParams the user could not have made: its validation speaks
        (
            [
                m.EngineCoreRequestType.ADD.value,
                m.encode_request(m.AddRequests([_request()]))[1].replace(b"\xa1n\x02", b"\xa1n\x00"),
            ],
            "n must be",
        ),
    ],
)
def test_garbled_request_is_a_protocol_error(frames, error):
    with pytest.raises(m.ProtocolError, match=error):
        m.decode_request(frames)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\xa4nope\x01", m.encode_request(m.AbortRequests(["a"]))[1]])
def test_garbled_output_is_a_protocol_error(data):
    with pytest.raises(m.ProtocolError, match="garbled message from the engine core"):
        m.decode_output(data)


def test_core_proc_ends_on_a_garbled_frame():
    """The core loop raises (run_engine_core then reports EngineCoreError and exits, so the
    server's requests fail with EngineDeadError) instead of dropping the frame and leaving a
    request to wait forever."""
    import zmq
    from pagedllm.engine.core_proc import EngineCoreProc

    class Socket:
        def __init__(self, frames):
            self.frames = frames

        def recv_multipart(self, flags=0):
            if not self.frames:
                raise zmq.Again()
            return self.frames.pop(0)

    class Core:
        scheduler = None

    p = EngineCoreProc(Core(), Socket([[b"\x7f", b""]]), None, 0)
    with pytest.raises(m.ProtocolError, match="unknown engine core request type"):
        p.drain()


def test_offline_engine_imports_no_msgspec():
    code = (
        "import sys, pagedllm.entrypoints.llm, pagedllm.engine.llm_engine; "
        "print(sorted(k for k in ('msgspec', 'zmq') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
