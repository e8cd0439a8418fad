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
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Optional[Any] = None  # pagedllm.lora.LoRARequest, or None: the base model
    # Several KV cache groups (core/kv_cache_utils.py): every group's table (block_ids is
    # group 0's); () with one group.
    block_ids_by_group: tuple[list[int], ...] = ()
    mm_inputs: tuple = ()  # multimodal.inputs.ImageInput of each image of the prompt


@dataclass
class CachedRequestData:
    """A request already in the batch: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended from outside (beam search)
    new_block_ids_by_group: tuple[list[int], ...] = ()  # several KV cache groups: each one's


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    # Structured output: the constrained requests that sample this step, and their token bitmask
    # rows in that order (numpy int32 [len(ids), ceil(V / 32)], filled by the engine core).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Optional[Any] = None
    # P/D disaggregation: what the worker side of the KV connector loads and saves this step.
    kv_connector_metadata: Optional[Any] = None
    # Speculative decoding: req id -> the draft tokens scheduled after its last token (counted in
    # num_scheduled_tokens; the runner verifies them and samples the bonus token).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # rows of the step, in batch order
    sampled_token_ids: list[list[int]]  # [] for a request still in a prefill chunk
    # Per sampled row, one entry per new token (several with accepted drafts): ([token ids],
    # [logprobs], rank of the token); the token first, then the top k.
    logprobs: Optional[list[Optional[list[tuple[list[int], list[float], int]]]]] = None
    # Rows that asked for prompt logprobs: req id -> the positions this step scored
    # (worker/prompt_logprobs.py: (first prompt index, [n][k+1] ids, [n][k+1] logprobs, [n] ranks)).
    prompt_logprobs: Optional[dict[str, tuple[int, list[list[int]], list[list[float]], list[int]]]] = None
    # --runner pooling: per row, the prompt's pooled vector once its last token is computed.
    pooler_output: Optional[list[Optional[list[float]]]] = None
    # The KV connector's finished / failed transfers (distributed/kv_transfer/base.KVConnectorOutput).
    kv_connector_output: Optional[Any] = None
    # Speculative decoding: per row, the drafts proposed for the next step ([] for none).
    spec_token_ids: Optional[list[list[int]]] = None
    # Vision-language models: the encoder cache's (queries, hits) of the step (worker/encoder_cache.py).
    encoder_stats: Optional[tuple[int, int]] = None


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    new_logprobs: Optional[list[tuple[list[int], list[float], int]]] = None
    num_cached_tokens: int = 0
    # With the first token of a request that asked for them: the logprobs of prompt tokens
    # 1..P-1, each ([prompt token, top k...] ids, logprobs, rank of the prompt token).
    prompt_logprobs: Optional[list[tuple[list[int], list[float], int]]] = None
    pooled: Optional[list[float]] = None  # --runner pooling: the request's embedding (it ends with it)
    # P/D: a finished prefill's KV location for the decode instance (vLLM's kv_transfer_params).
    kv_transfer_params: Optional[dict] = None
