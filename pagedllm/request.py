"""Request: one prompt + its sampling params, as the scheduler sees it (no torch here)."""

from __future__ import annotations

import enum
import time
from typing import Optional

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1  # in the waiting queue until its grammar is compiled (structured output)
    WAITING_FOR_REMOTE_KVS = 2  # holds its blocks while a KV connector loads them; computes nothing
    RUNNING = 3
    PREEMPTED = 4
    # Everything past this line is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None  # the stop token id or stop string
        self.num_preemptions = 0
        # --scheduling-policy priority: lower runs earlier (ties by arrival_time), as vLLM's priority.
        self.priority = 0
        self.max_tokens = sampling_params.max_tokens  # resolved by the engine when None
        self.extra_keys: tuple = ()  # keys that must never share cached blocks (e.g. a LoRA id)
        self.lora_request = None  # pagedllm.lora.LoRARequest, or None: the base model
        self.mm_inputs: tuple = ()  # multimodal.inputs.ImageInput of each image, in prompt order
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache (-1: not yet looked up)
        # Beam search: the beams of one search share a group id; they are preempted and
        # re-admitted together (a beam that has reported waits for its siblings while holding
        # its blocks, so a search split between running and waiting could wait forever).
        self.group_id: Optional[str] = None
        self.fork_width = 1  # a search's first beam: the number of beams it becomes
        so = sampling_params.structured_outputs
        self.structured_output_request = StructuredOutputRequest(so) if so is not None else None
        if so is not None:
            self.status = RequestStatus.WAITING_FOR_FSM
        # prompt_logprobs: the scored prompt tokens gathered so far (ids, logprobs, rank each),
        # sent with the first token and then None (a recompute after preemption adds nothing).
        self.prompt_logprobs: Optional[list] = [] if sampling_params.prompt_logprobs is not None else None
        # P/D disaggregation (distributed/kv_transfer): the request's own copy (the connector
        # marks a remote prefill as consumed in it).
        params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.kv_transfer_params: Optional[dict] = dict(params) if params else None
        # Speculative decoding: the draft tokens proposed after the last step, verified in the next
        # (never part of all_token_ids; dropped on preemption).
        self.spec_token_ids: list[int] = []
        # Async scheduling (core/async_scheduler.py): tokens sampled by steps still in flight,
        # not yet in all_token_ids (vLLM's num_output_placeholders; 0 otherwise).
        self.num_output_placeholders = 0

    def add_prompt_logprobs(self, chunk) -> None:
        """One step's scored positions (worker/prompt_logprobs.py); positions already held (a
        prefill recomputed after preemption) are skipped."""
        if self.prompt_logprobs is None:
            return
        start, ids, lps, ranks = chunk
        skip = len(self.prompt_logprobs) + 1 - start
        if skip < 0:  # the prefix cache is skipped for these requests: no gap can arise
            raise RuntimeError(
                f"prompt logprobs of {self.request_id} from token {start}, after {len(self.prompt_logprobs)}"
            )
        self.prompt_logprobs.extend(zip(ids[skip:], lps[skip:], ranks[skip:]))

    def take_prompt_logprobs(self) -> Optional[list]:
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this request will run as (seed 001): a parallel-sampling parent
        forks into its n / best_of siblings, a beam search's first beam into its beams."""
        return max(self.sampling_params.num_samples, self.fork_width)

    def make_child(self, index: int) -> "Request":
        """A sibling of a parallel-sampling request (n > 1): same prompt, own sampling stream."""
        child = Request(
            child_request_id(self.request_id, index),
            self.prompt_token_ids,
            self.sampling_params.child(index),
            self.eos_token_id,
            self.arrival_time,
        )
        child.max_tokens = self.max_tokens
        child.extra_keys, child.lora_request = self.extra_keys, self.lora_request
        child.mm_inputs = self.mm_inputs
        child.priority = self.priority
        if self.structured_output_request is not None:  # the same grammar, its own matcher
            child.structured_output_request = self.structured_output_request.fork()
        return child

    # ------------------------------------------------------------ lengths
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    # ------------------------------------------------------------- status
    def priority_key(self) -> tuple[int, float]:
        """The order of --scheduling-policy priority: lower priority first, then older first."""
        return self.priority, self.arrival_time

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[FinishReason]:
        return _FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
