"""The messages between the API server process and the EngineCore process, as msgspec Structs.

server -> core: two ZMQ frames, [EngineCoreRequestType, payload]; the type picks the payload's
Struct (one Decoder per type, built once):

  ADD        AddRequests(requests: [EngineCoreRequest])    requests as the Processor made them
  BEAM       BeamSearchStart(request, width, length_penalty, eos_token_id)
  ABORT      AbortRequests(request_ids)                    a beam search's id ends the search
  UTILITY    UtilityRequest(call_id, method, args)         answered by a UtilityOutput
  SHUTDOWN   (empty)

core -> server: one frame, a tagged union (the tag is the array's first item) read by one
Decoder:

  EngineCoreReady(num_blocks, pid, kv_cache_config)
                                              once, when the core has started
  EngineCoreOutputs(outputs, scheduler_stats, queue_times, beam_results, failed)
                                              after every step, and after messages that changed
                                              the scheduler while idle (then only the stats)
  UtilityOutput(call_id, result, error)
  EngineCoreError(exc_type, message)          the core failed to start, or is dying

EngineCoreOutput, SamplingParams and the beam search's results are dataclasses the offline
engine uses; msgspec encodes them as they are (this module alone imports msgspec, so the offline
path never does). A beam search's beams never leave the core: one BeamResult for the search's
id comes back when it ends, or at once with an error when the core refuses it. `failed`: the
requests a failed step ended (engine/step_failures.py); a beam search's by the search's id.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Union

import msgspec
import numpy as np

from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.beam_search import BeamSearchOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import ImageInput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


class ProtocolError(RuntimeError):
    """A frame that is not a message of this protocol (a bug or a foreign sender)."""


class EngineCoreRequestType(enum.Enum):
    """The first frame of a server -> core message."""

    ADD = b"\x00"
    BEAM = b"\x01"
    ABORT = b"\x02"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"


# ---------------------------------------------------------------- server -> core
class ImageInputWire(msgspec.Struct, array_like=True):
    """multimodal.inputs.ImageInput with its pixels as float32 bytes."""

    offset: int
    length: int
    hash: int
    shape: list[int]
    pixels: bytes
    runs: Optional[list[list[int]]] = None

    @classmethod
    def of(cls, image: ImageInput) -> "ImageInputWire":
        pixels = np.ascontiguousarray(image.pixel_values, dtype=np.float32)
        runs = [list(r) for r in image.runs] if image.runs is not None else None
        return cls(image.offset, image.length, image.hash, list(pixels.shape), pixels.tobytes(), runs)

    def to_input(self) -> ImageInput:
        pixels = np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)
        runs = tuple(tuple(r) for r in self.runs) if self.runs is not None else None
        return ImageInput(self.offset, self.length, self.hash, pixels, runs)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A Request as the Processor made it (nothing computed yet)."""

    request_id: str
    prompt_token_ids: list[int]
    # Decoding re-runs SamplingParams.__post_init__, which resets all_stop_token_ids to the
    # user's stop_token_ids: the engine's EOS extras travel in all_stop_token_ids below.
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    max_tokens: Optional[int]
    all_stop_token_ids: list[int] = []
    extra_keys: tuple = ()
    lora_request: Optional[LoRARequest] = None
    mm_inputs: list[ImageInputWire] = []
    priority: int = 0

    def __post_init__(self) -> None:  # also run by the decoder
        self.sampling_params.all_stop_token_ids = set(self.all_stop_token_ids)
        self.extra_keys = _tuples(self.extra_keys)  # msgpack made lists of the nested tuples

    @classmethod
    def from_request(cls, r: Request) -> "EngineCoreRequest":
        return cls(
            r.request_id,
            r.prompt_token_ids,
            r.sampling_params,
            r.eos_token_id,
            r.arrival_time,
            r.max_tokens,
            sorted(r.sampling_params.all_stop_token_ids),
            r.extra_keys,
            r.lora_request,
            [ImageInputWire.of(m) for m in r.mm_inputs],
            r.priority,
        )

    def to_request(self) -> Request:
        r = Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
        )
        r.max_tokens = self.max_tokens
        r.extra_keys, r.lora_request = self.extra_keys, self.lora_request
        r.mm_inputs = tuple(m.to_input() for m in self.mm_inputs)
        r.priority = self.priority
        return r


class AddRequests(msgspec.Struct, array_like=True):
    requests: list[EngineCoreRequest]


class BeamSearchStart(msgspec.Struct, array_like=True):
    """Start a beam search in the core (engine/beam_search.py); request: its first beam."""

    request: EngineCoreRequest
    width: int
    length_penalty: float
    eos_token_id: Optional[int]  # None: ignore EOS


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list = []


class Shutdown(msgspec.Struct, array_like=True):
    pass


_REQUEST_TYPES: dict[EngineCoreRequestType, type] = {
    EngineCoreRequestType.ADD: AddRequests,
    EngineCoreRequestType.BEAM: BeamSearchStart,
    EngineCoreRequestType.ABORT: AbortRequests,
    EngineCoreRequestType.UTILITY: UtilityRequest,
    EngineCoreRequestType.SHUTDOWN: Shutdown,
}
_TYPE_OF = {cls: t for t, cls in _REQUEST_TYPES.items()}
CoreRequest = Union[AddRequests, BeamSearchStart, AbortRequests, UtilityRequest, Shutdown]


# ---------------------------------------------------------------- core -> server
class SchedulerStats(msgspec.Struct):
    """The scheduler's state after the step (or the idle message) that sent it."""

    running: int
    waiting: int
    kv_usage: float
    used_blocks: int
    num_blocks: int
    preemptions: int
    num_added: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    mm_cache_queries: int = 0  # images looked up in the encoder cache, and found there (vLLM's names)
    mm_cache_hits: int = 0
    # --enable-lora: adapter name -> its requests running / waiting (vLLM's lora_requests_info).
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    # Speculative decoding's totals (spec_decode/metrics.SpecDecodingStats.as_dict); None without it.
    spec_decoding: Optional[dict] = None
    # Data parallel only (DPCoreClient's sum, never sent by a core): each replica's own, and
    # the router's requests in flight per replica.
    replicas: Optional[list[Optional["SchedulerStats"]]] = None
    router_loads: Optional[list[int]] = None

    def as_dict(self) -> dict:
        """The form the metrics and the stats endpoint read."""
        d = msgspec.structs.asdict(self)
        if self.replicas is None:
            del d["replicas"], d["router_loads"]
        else:
            d["replicas"] = [r.as_dict() if r is not None else None for r in self.replicas]
        return d


class BeamResult(msgspec.Struct, array_like=True, omit_defaults=True):
    output: BeamSearchOutput
    error: Optional[str] = None  # the core refused the search


class FailedRequest(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    client_error: bool  # a ValueError: the request's own fault (HTTP 400, else 500)


class EngineCoreReady(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    pid: int
    kv_cache_config: KVCacheConfig  # the layout the core's KV cache manager keeps


class EngineCoreOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    queue_times: list[tuple[str, float]] = []  # (request id, seconds waiting) of the newly scheduled
    beam_results: list[BeamResult] = []
    failed: list[FailedRequest] = []


class UtilityOutput(msgspec.Struct, tag="util", array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: Optional[str] = None


class EngineCoreError(msgspec.Struct, tag="error", array_like=True):
    exc_type: str
    message: str


CoreOutput = Union[EngineCoreReady, EngineCoreOutputs, UtilityOutput, EngineCoreError]


# ---------------------------------------------------------------- codecs (built once)
_encoder = msgspec.msgpack.Encoder()
_request_decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in _REQUEST_TYPES.items()}
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode_request(msg: CoreRequest) -> list[bytes]:
    """The frames of a server -> core message."""
    return [_TYPE_OF[type(msg)].value, _encoder.encode(msg)]


def decode_request(frames: list[bytes]) -> CoreRequest:
    if len(frames) != 2:
        raise ProtocolError(f"a request to the engine core has 2 frames, got {len(frames)}")
    try:
        decoder = _request_decoders[EngineCoreRequestType(frames[0])]
    except ValueError:
        raise ProtocolError(f"unknown engine core request type {frames[0]!r}") from None
    try:
        return decoder.decode(frames[1])
    except msgspec.DecodeError as e:  # ValidationError too
        raise ProtocolError(f"a garbled {decoder.type.__name__} message: {e}") from e


def encode_output(msg: CoreOutput) -> bytes:
    return _encoder.encode(msg)


def decode_output(data: bytes) -> CoreOutput:
    try:
        return _output_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"a garbled message from the engine core: {e}") from e


def _tuples(v):
    """Nested tuples from the lists msgpack made of them (extra keys are hashed as tuples)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v
