"""Async scheduling (vLLM's `async_scheduling=True`): step N+1 is scheduled while step N runs.

The engine core keeps two steps in flight (its batch queue, as for pipeline stages): it
schedules and submits step N+1, then waits for step N's output and applies it. A request that
samples in step N has one output placeholder until that output is in
(`Request.num_output_placeholders`); the scheduler counts it as a token to compute, so the
request's next decode is scheduled without waiting for the token, and the runner takes that
token from step N's sampled tensor on the device (worker/async_output.py). Stop checks run when
step N's output arrives: a request that stopped there has computed one token too many in step
N+1, which is dropped (its blocks are freed by then, and step N+1 has finished writing them
before any later step can use them: steps run in order on the device).

What it does not run (refused when the engine is built or the request arrives: engine/compat.py): speculative
decoding, beam search, structured outputs, pooling, P/D disaggregation, tensor or pipeline
parallelism.
"""

from __future__ import annotations

from typing import Iterable

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.request import Request


class AsyncScheduler(Scheduler):
    def _num_tokens_to_compute(self, request: Request) -> int:
        if request.num_output_placeholders and self._ends_with_placeholders(request):
            return 0  # the step in flight ends it (max_tokens / max_model_len): nothing more to run
        return super()._num_tokens_to_compute(request)

    def _ends_with_placeholders(self, request: Request) -> bool:
        """Whether the tokens in flight take the request to max_model_len or max_tokens."""
        n = request.num_output_placeholders
        return request.num_tokens + n >= self.config.max_model_len or (
            request.max_tokens is not None and request.num_output_tokens + n >= request.max_tokens
        )

    def _make_output(self, step) -> SchedulerOutput:
        out = super()._make_output(step)
        for req_id in step.num_scheduled:  # those that reach their last token sample: one placeholder
            request = self.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        for req_id, new_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if new_ids and request is not None:  # the token takes its placeholder's place
                request.num_output_placeholders -= len(new_ids)
        return super().update_from_output(scheduler_output, runner_output)

    def recompute_all(self, swapped_out: Iterable[str] = ()) -> None:
        """After a failed step: the steps in flight were dropped, so no output will come."""
        super().recompute_all(swapped_out)
        for request in self.requests.values():
            request.num_output_placeholders = 0
