"""The runner's side of async scheduling (core/async_scheduler.py): sampled tokens stay on the
device until the host needs them.

- `defer` ends a step without waiting for its tokens: it keeps the sampled tensor as the
  previous step's (`prev_tokens`, by request id), starts its copy to the host (pinned memory,
  an event behind it) and returns an AsyncModelRunnerOutput, whose `get_output` waits for that
  event only, never for the step submitted after it.
- The next step is scheduled before those tokens are on the host: a row whose scheduled
  position is its first unknown token (position == the row's known token count) takes it
  from `prev_tokens` on the device (`fill_placeholders`, one indexed copy).
- The host learns the tokens in `get_output` (on the engine's thread) and appends them to the
  runner's rows at the start of its next step (`apply_fetched`, on the runner's thread), for
  the rows whose state is still the same (a request preempted or finished since is skipped).
- Sampling that reads the output tokens themselves (penalties) waits for the previous step's
  tokens (`complete_output_ids`: one device -> host copy, only then); min_tokens needs only
  their count, which is known.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.worker.pinned_staging import PinnedStaging
from pagedllm.worker.runner_output import to_runner_output


class AsyncOutputs:
    def __init__(self, runner, max_num_reqs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.prev_tokens: Optional[torch.Tensor] = None  # [rows sampled last step] int64, on the device
        self.prev_index: dict[str, int] = {}  # req id -> its row in prev_tokens
        self.filled: dict[str, int] = {}  # this step: req id -> prev_tokens row it took
        self.fetched: deque = deque()  # (state, token) from get_output, to apply
        # One placeholder per request at most: the token of the step just before.
        self.staging = PinnedStaging(
            {"dst": ((max_num_reqs,), torch.int64), "src": ((max_num_reqs,), torch.int64)}, self.device
        )

    def reset(self) -> None:
        self.prev_tokens, self.prev_index, self.filled = None, {}, {}
        self.fetched.clear()

    def apply_fetched(self) -> None:
        """The tokens the host has learned since the last step, into the rows they belong to."""
        runner = self.runner
        batch = runner.input_batch
        while self.fetched:
            state, token = self.fetched.popleft()
            if runner.requests.get(state.req_id) is not state:
                continue  # finished or preempted since it sampled: its state is gone
            row = batch.req_id_to_index.get(state.req_id)
            if row is not None:
                batch.append_token(row, token)
            else:  # out of the batch this step: its state keeps the token for its return
                state.token_ids.append(token)

    def fill_placeholders(self, input_ids: torch.Tensor, inputs) -> None:
        """input_ids [num_tokens] on the device: the tokens the host does not know yet, from the
        previous step's sampled tensor."""
        self.filled = {}
        batch = self.runner.input_batch
        positions = inputs.positions.numpy()
        known = batch.num_tokens[inputs.request_indices]  # [num_tokens]
        dst = np.flatnonzero(positions >= known)  # [m] token indices
        if not len(dst):
            return
        if np.any(positions[dst] > known[dst]):
            raise RuntimeError("async scheduling: a row is more than one token ahead of the host")
        src = []
        for r in inputs.request_indices[dst].tolist():  # one per request
            req_id = inputs.req_ids[r]
            i = self.prev_index.get(req_id)
            if i is None:
                raise RuntimeError(f"async scheduling: no sampled token in flight for {req_id}")
            self.filled[req_id] = i
            src.append(i)
        src = np.asarray(src, dtype=np.int64)
        dst_t, src_t = self.staging.upload(dst=dst, src=src)
        input_ids.index_copy_(0, dst_t, self.prev_tokens.index_select(0, src_t))  # no host sync

    def complete_output_ids(self, states, output_token_ids: list[list[int]], need_ids: bool) -> list[list[int]]:
        """Each state's output tokens with the one still on the device appended: its id when
        need_ids (penalties: waits for the previous step), else a stand-in (only the count is read)."""
        missing = [k for k, s in enumerate(states) if s.req_id in self.filled]
        if not missing:
            return output_token_ids
        if need_ids:
            idx = torch.tensor([self.filled[states[k].req_id] for k in missing], device=self.device)
            values = self.prev_tokens[idx].tolist()
        else:
            values = [0] * len(missing)
        out = list(output_token_ids)
        for k, v in zip(missing, values):
            out[k] = list(out[k]) + [v]
        return out

    def defer(self, req_ids: list[str], rows: list[int], states, sampler_output, prompt_logprobs):
        """The step's output, its tokens left on the device -> AsyncModelRunnerOutput."""
        if sampler_output is None:
            self.prev_tokens, self.prev_index = None, {}
        else:
            self.prev_tokens = sampler_output.sampled_token_ids
            self.prev_index = {req_ids[r]: i for i, r in enumerate(rows)}
        return AsyncModelRunnerOutput(self, req_ids, rows, states, sampler_output, prompt_logprobs)


class AsyncModelRunnerOutput:
    """A step's output whose sampled tokens (and logprobs) are on their way to the host."""

    def __init__(self, outputs: AsyncOutputs, req_ids, rows, states, sampler_output, prompt_logprobs) -> None:
        self.outputs = outputs
        self.req_ids, self.rows, self.states = req_ids, rows, states
        self.prompt_logprobs = prompt_logprobs
        self.event = None
        self.host = sampler_output
        if sampler_output is not None and outputs.device.type == "cuda":
            # Enqueued behind this step's sampler, before anything of the next step: a
            # non-blocking device -> host copy lands in pinned memory.
            self.host = type(sampler_output)(
                *(
                    None if t is None else t.to("cpu", non_blocking=True)
                    for t in (
                        sampler_output.sampled_token_ids,
                        sampler_output.logprob_token_ids,
                        sampler_output.logprobs,
                        sampler_output.sampled_token_ranks,
                    )
                )
            )
            self.event = torch.cuda.Event()
            self.event.record()

    def get_output(self) -> ModelRunnerOutput:
        if self.event is not None:
            self.event.synchronize()  # this step's copies only
        fetched = self.outputs.fetched
        result = to_runner_output(
            self.req_ids, self.rows, self.states, self.host, lambda row, state, token: fetched.append((state, token))
        )
        result.prompt_logprobs = self.prompt_logprobs
        return result
