"""A step that raises: the engine goes on, and only the request that caused it fails.

When the model runner raises in a step, nothing that step did can be trusted: the scheduler
had counted its tokens as computed, the runner's persistent rows may be half updated, blocks
hashed for the prefix cache may never have been written. So the core rolls back to a state it
can trust: the runner forgets every row, every running request goes back to the waiting queue
to be computed again from its tokens, and the prefix cache is emptied.

Then it finds the culprit. A failed step of one request (or of the beams of one search)
convicts it. A failed step of several makes them suspects: each suspect runs alone (with its
search's other beams), one per step, until it has run a step without failing (cleared) or
failed alone (convicted); the others wait meanwhile (a few steps). A request that was in
MAX_FAILED_STEPS failed steps is convicted too, so that a fault that shows only in company
cannot loop forever. A convicted request is ended (its blocks go
back) and the step raises RequestFailedError naming it, for the caller to tell its client.

Failures that leave nothing to roll back to (a split model's executor, which refuses further
steps; a broken CUDA context) are raised as they are: the engine core dies, and the server
exits or restarts it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.executor.abstract import ExecutorError
from pagedllm.request import RequestStatus

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3


def _unrecoverable(e: Exception) -> bool:
    if isinstance(e, ExecutorError):  # a split model's executor: it has shut its workers down
        return True
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)  # the CUDA context is broken
    return accelerator_error is not None and isinstance(e, accelerator_error)


class StepFailures:
    """The engine core's failed steps: roll back, isolate, convict (see the module's doc)."""

    def __init__(self, scheduler, executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.suspects: deque[str] = deque()
        self.failed_steps: dict[str, int] = {}  # request id -> failed steps it was in
        self.probing: Optional[str] = None

    def schedule(self) -> SchedulerOutput:
        """The next step: the first suspect alone while there are suspects, else as usual."""
        sched = self.scheduler
        while self.suspects:
            request = sched.get_request(self.suspects[0])
            if request is None or request.is_finished():
                self.suspects.popleft()
                continue
            so = sched.schedule_alone(request)
            if so.total_num_scheduled_tokens > 0:
                self.probing = request.request_id
            else:  # it cannot run alone now (no free block): it runs with the others again
                self.suspects.popleft()
            return so
        return sched.schedule()

    def step_done(self, so: SchedulerOutput) -> None:
        if self.probing is not None:
            self.suspects.remove(self.probing)
            self.probing = None

    def step_failed(self, so: SchedulerOutput, e: Exception) -> None:
        """Roll back and isolate; raises RequestFailedError when a request is convicted, and
        `e` itself when the engine cannot go on."""
        if _unrecoverable(e):
            raise e
        sched = self.scheduler
        step = list(so.num_scheduled_tokens)
        logger.error(
            "a step of %d request(s) failed (%s: %s): rolling back", len(step), type(e).__name__, e, exc_info=e
        )
        self.executor.reset()
        sched.finished_req_ids |= so.finished_req_ids  # the runner may not have seen them
        sched.recompute_all(swapped_out=so.preempted_req_ids)
        self.probing = None
        self.failed_steps = {r: n for r, n in self.failed_steps.items() if r in sched.requests}
        for req_id in step:
            self.failed_steps[req_id] = self.failed_steps.get(req_id, 0) + 1
        # One request, or the beams of one search (they run and end together), is the culprit.
        units = {getattr(sched.get_request(r), "group_id", None) or r for r in step}
        convicted = [r for r in step if len(units) == 1 or self.failed_steps[r] >= MAX_FAILED_STEPS]
        self.suspects.extend(r for r in step if r not in convicted and r not in self.suspects)
        if not convicted:
            return
        for req_id in convicted:
            self.failed_steps.pop(req_id, None)
            if req_id in self.suspects:
                self.suspects.remove(req_id)
        sched.finish_requests(convicted, RequestStatus.FINISHED_ABORTED)
        raise RequestFailedError.caused_by(convicted, e) from e
