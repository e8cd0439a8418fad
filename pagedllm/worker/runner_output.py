"""The sampler's output as the scheduler takes it (ModelRunnerOutput): shared by the runner, the
pipeline runner and async outputs (worker/async_output.py)."""

from __future__ import annotations

from typing import Callable

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.worker.input_batch import CachedRequestState


def to_runner_output(
    req_ids: list[str],
    rows: list[int],
    states: list[CachedRequestState],
    out,
    append: Callable[[int, CachedRequestState, int], None],
) -> ModelRunnerOutput:
    """The sampler's output (None: no row sampled) as the scheduler takes it: one token for each
    sampling row (`rows` index req_ids; `states` are their requests), with the sampled token's
    logprob, rank and the top k the request asked for. `append(row, state, token)` keeps the
    runner's copy of the tokens (not for beams: their next token is chosen outside)."""
    sampled: list[list[int]] = [[] for _ in req_ids]
    logprobs = None
    if out is None:
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
    token_ids = out.sampled_token_ids.tolist()
    if out.logprobs is not None:
        logprobs = [None] * len(req_ids)
        ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_token_ranks.tolist()
    for i, (row, state) in enumerate(zip(rows, states)):
        sampled[row] = [token_ids[i]]
        params = state.sampling_params
        if not params.external_tokens:
            append(row, state, token_ids[i])
        if logprobs is not None and params.logprobs is not None:
            k = params.logprobs
            logprobs[row] = [(ids[i][: k + 1], lps[i][: k + 1], ranks[i])]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)
