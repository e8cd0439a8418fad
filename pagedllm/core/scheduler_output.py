"""What the scheduler hands the model runner each step, and what comes back. Plain data only,
so that it can cross a process boundary (msgspec) unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the batch: new, or resumed after preemption (then all its tokens)."""
    req_id: str
    token_ids: list[int]            # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request already in the batch: only what changed."""
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended from outside (beam search)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)   # (src, dst): copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, device)
    # Structured output: the constrained requests that sample this step, and their token bitmask
    # rows in that order (numpy int32 [len(ids), ceil(V / 32)], filled by the engine core).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Optional[Any] = None


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]                       # rows of the step, in batch order
    sampled_token_ids: list[list[int]]       # [] for a request still in a prefill chunk
    # Per sampled row: ([token ids], [logprobs], rank of the sampled token); sampled first.
    logprobs: Optional[list[Optional[tuple[list[int], list[float], int]]]] = None


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    new_logprobs: Optional[list[tuple[list[int], list[float], int]]] = None
    num_cached_tokens: int = 0
