"""The public result types of LLM.generate (and of the server's engine client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


# One position's logprobs: token id -> Logprob.
@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing precedes it), then {prompt token and top k: Logprob}.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or None while running
    stop_reason: Optional[int | str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: Optional[PromptLogprobs] = None  # SamplingParams.prompt_logprobs (vLLM's shape)
    # P/D disaggregation: where a finished prefill's KV waits for the decode instance (vLLM's).
    kv_transfer_params: Optional[dict] = None


@dataclass
class PoolingOutput:
    """A prompt's pooled hidden state (vLLM's shape: `.outputs.embedding`)."""

    embedding: list[float]


@dataclass
class PoolingRequestOutput:
    """The result of one prompt on a `runner="pooling"` engine (LLM.embed, /v1/embeddings)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
