"""The model runner of one rank of a model split by tensor / pipeline parallelism.

Every rank keeps the same persistent InputBatch as the driver (rank 0) and runs the same
`SchedulerOutput` each step, so that every rank builds the same positions, slot mapping and
attention metadata for its own shard of the model and its own KV cache (same block layout,
its own KV heads / layers). Only the driver samples; its runner keeps the tokens it appended
since the last message to the others (`take_sampled`), and they go with that message. The
others apply them before they bring their batch in step with it: the same order in which the
driver appended them, so every rank's batch stays identical.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.worker.input_batch import CachedRequestState
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.runner_output import to_runner_output
from pagedllm.worker.sampler import SamplingMetadata

logger = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A pipelined step submitted on stage 0, waiting for the last stage's hidden states."""

    req_ids: list[str]
    rows: list[int]  # rows that sample, in the step's batch order
    states: list[CachedRequestState]  # their states (they may leave the batch meanwhile)
    sampling: Optional[SamplingMetadata]  # None: no row samples, or all are plain greedy


class ParallelModelRunner(ModelRunner):
    """ModelRunner over one rank's shard.

    Tensor parallelism only (one stage): the driver calls execute_model (the base class: the
    model's row-parallel layers all-reduce, the LM head gathers the logits on the driver, which
    samples); the other ranks call execute_model_worker.

    Pipeline parallelism: a step is submitted on every rank (stage 0 embeds and runs its layers,
    every stage hands its hidden states to the next without waiting, the last stage sends the
    final hidden states of the rows that sample back to stage 0) and finished later on stage 0
    (receive those rows, LM head, sample). Between the two, stage 0 can submit the next steps:
    that keeps several steps in flight (EngineCore's batch queue). The states of a step's
    sampled rows are captured at submit time, since the batch moves on meanwhile.
    """

    def __init__(self, config: EngineConfig, parallel, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, parallel, eos_token_ids)
        self.hidden_size = config.model_config.hidden_size
        self._pending_rows: deque[int] = deque()  # stage-0 TP workers: rows of unfinished steps
        # Driver: tokens appended since the last message to the other ranks (take_sampled).
        self._sampled: dict[str, list[int]] = {}

    # ------------------------------------------------------------ pipeline stages
    def _run_stage(self, inputs, meta) -> None:
        """This rank's layers for one step, handing the result on (pipeline only)."""
        pc = self.parallel
        hidden_in = None
        if not pc.is_first_stage:
            hidden_in = pc.recv_prev(torch.empty(inputs.input_ids.shape[0], self.hidden_size, dtype=self.dtype))
        with set_forward_context(meta):
            hidden = self.model(inputs.input_ids, inputs.positions, hidden_in)
        if not pc.is_last_stage:
            pc.send_next(hidden)
        elif len(inputs.sample_rows):
            # Only the rows that sample go back to stage 0, which holds the LM head.
            pc.send_to_first(hidden[inputs.logits_indices])

    def _recv_final_rows(self, num_rows: int) -> torch.Tensor:
        return self.parallel.recv_from_last(torch.empty(num_rows, self.hidden_size, dtype=self.dtype))

    def _advance(self, inputs) -> None:
        batch = self.input_batch
        batch.num_computed_tokens_cpu[: batch.num_reqs] += inputs.num_scheduled_tokens.astype(np.int32)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.parallel.pp_size > 1:
            return self.finish_step(self.submit_step(so))
        out = super().execute_model(so)
        self._record(out)
        return out

    def _record(self, out: ModelRunnerOutput) -> None:
        for req_id, token_ids in zip(out.req_ids, out.sampled_token_ids):
            if token_ids:
                self._sampled.setdefault(req_id, []).extend(token_ids)

    def take_sampled(self) -> dict[str, list[int]]:
        """Driver: the tokens sampled since the last call, for the other ranks' next step."""
        sampled, self._sampled = self._sampled, {}
        return sampled

    @torch.inference_mode()
    def submit_step(self, so: SchedulerOutput) -> Optional[PendingStep]:
        """Driver, pipeline: stage 0's part of a step; None when nothing runs."""
        prepared = self._prepare(so)
        if prepared is None:
            return None
        inputs, meta = prepared
        self._run_stage(inputs, meta)
        rows = inputs.sample_rows
        batch = self.input_batch
        pending = PendingStep(
            inputs.req_ids,
            rows.tolist(),
            [batch.states[r] for r in rows.tolist()],
            self._sampling_metadata(rows) if len(rows) else None,
        )
        self._advance(inputs)
        return pending

    @torch.inference_mode()
    def finish_step(self, pending: Optional[PendingStep]) -> ModelRunnerOutput:
        """Driver, pipeline: receive the step's final hidden states, sample, append. A request
        whose state was dropped since the submit (preempted or finished by a later step) gets
        no token: a preempted one recomputes from scratch, and its state may be a new one."""
        if pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        out = None
        if pending.rows:
            logits = self.model.compute_logits(self._recv_final_rows(len(pending.rows)))
            out = self.sampler(logits, pending.sampling)
        batch = self.input_batch

        def append(row: int, state: CachedRequestState, token: int) -> None:
            now = batch.req_id_to_index.get(state.req_id)  # the batch has moved on since submit
            if now is not None and batch.states[now] is state:
                batch.append_token(now, token)
            else:  # out of the batch (it is in flight, or gone): its state only
                state.token_ids.append(token)

        result = to_runner_output(pending.req_ids, pending.rows, pending.states, out, append)
        for row, state in zip(pending.rows, pending.states):
            if self.requests.get(state.req_id) is not state:
                result.sampled_token_ids[row] = []
        self._record(result)
        return result

    # ------------------------------------------------------------ the other ranks
    def apply_sampled(self, sampled: dict[str, list[int]]) -> None:
        """The tokens the driver sampled (and appended) in the steps it finished since the last
        message. A request that sampled is out of the batch until it has its token (the
        scheduler does not schedule it again before), so the order matches the driver's."""
        batch = self.input_batch
        for req_id, token_ids in sampled.items():
            state = self.requests.get(req_id)
            if state is None or state.sampling_params.external_tokens:
                continue  # finished or preempted meanwhile
            row = batch.req_id_to_index.get(req_id)
            for t in token_ids:
                if row is not None:
                    batch.append_token(row, t)
                else:
                    state.token_ids.append(t)

    @torch.inference_mode()
    def execute_model_worker(self, so: SchedulerOutput, prev_sampled: dict[str, list[int]]) -> None:
        self.apply_sampled(prev_sampled)
        prepared = self._prepare(so)
        pc = self.parallel
        if prepared is None:
            if pc.pp_size > 1 and pc.is_first_stage:
                self._pending_rows.append(-1)
            return
        inputs, meta = prepared
        if pc.pp_size == 1:
            hidden = self._forward(inputs, meta)
            if len(inputs.sample_rows):
                self.model.compute_logits(hidden[inputs.logits_indices])  # this rank's vocab slice
        else:
            self._run_stage(inputs, meta)
            if pc.is_first_stage:
                self._pending_rows.append(len(inputs.sample_rows))
        self._advance(inputs)

    @torch.inference_mode()
    def finish_step_worker(self) -> None:
        """Stage-0 TP ranks other than the driver: their share of the LM head for the oldest
        unfinished step (the driver gathers and samples)."""
        num_rows = self._pending_rows.popleft()
        if num_rows > 0:
            self.model.compute_logits(self._recv_final_rows(num_rows))
