"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

There is no prefill or decode phase: each step every request's `num_computed_tokens`
catches up with its `num_tokens` as far as the token budget allows. Running requests are
served first (in order), then waiting ones, first come first served. When a running
request needs a block and none is free, the newest running request is preempted: all
its blocks go back and it returns to the front of the waiting queue.

With --scheduling-policy priority both queues are kept in (priority, arrival) order, so the
same rule preempts the newest of the lowest-priority requests; and a waiting request that
cannot start for want of blocks or sequence slots preempts running requests of lower
priority than its own, by that rule, before the step is planned (vLLM's priority policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

from pagedllm.core.encoder_cache_manager import trim_to_encoder_budget
from pagedllm.core.kv_cache_manager import KVCacheManager, check_fits_kv_cache
from pagedllm.core.remote_kv import RemoteKV
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.request import FinishReason, Request, RequestStatus
from pagedllm.spec_decode.metrics import SpecDecodingStats
from pagedllm.spec_decode.scheduling import trim_spec_tokens

if TYPE_CHECKING:  # the engine's config module reads config.json (pagedllm.models)
    from pagedllm.config import SchedulerConfig


@dataclass
class _Step:
    """What one `Scheduler.schedule()` has decided so far: the budget left, the tokens and new
    blocks of each scheduled request, which are new to the runner, which preempted."""

    budget: int
    encoder_budget: int = 0  # image tokens the step may still encode
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids_by_group: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)  # draft tokens scheduled per request


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector=None) -> None:
        """connector: the scheduler side of a KV connector (P/D disaggregation), or None."""
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended since the last step: the runner drops their rows.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_swaps = 0
        # Forked siblings the model runner has not seen yet: sent as new when first scheduled.
        self.unsent: set[str] = set()
        # Tokens appended from outside (beam search) that the runner has not seen yet.
        self.pending_tokens: dict[str, list[int]] = {}
        # Ended because their grammar failed to compile: reported by the next update.
        self.grammar_failed: list[Request] = []
        self.connector = connector
        self.remote_kv = RemoteKV(connector, kv_cache_manager) if connector is not None else None
        # Requests whose remote KV failed to load: ended, for the engine core to report.
        self.kv_load_failures: list[tuple[str, str]] = []
        # Speculative decoding's acceptance counters (metrics, the stats log line).
        self.spec_decoding_stats = SpecDecodingStats()
        # The runner's encoder cache: images looked up, and found without an encoder run (metrics).
        self.mm_cache_queries = self.mm_cache_hits = 0

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        width = request.get_max_num_running_seqs()
        if width > self.config.max_num_seqs:
            raise ValueError(f"n / best_of / beam width ({width}) must be <= max_num_seqs ({self.config.max_num_seqs})")
        if request.fork_width > 1:  # a search whose beams cannot all fit would wait forever
            kv, max_len = self.kv_cache_manager, self.config.max_model_len
            max_tokens = max_len - request.num_tokens if request.max_tokens is None else request.max_tokens
            check_fits_kv_cache(
                request.num_prompt_tokens,
                max_tokens,
                request.fork_width,
                kv.block_size,
                kv.block_pool.num_blocks,
                max_len,
                kv.kv_cache_config,
                self.config.max_num_batched_tokens,
            )
        if request.sampling_params.num_samples > 1 and request.num_prompt_tokens == 1:
            # Nothing to share before the last prompt token: the siblings start on their own.
            for i in range(request.sampling_params.num_samples):
                self.add_request(request.make_child(i))
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string): their blocks go back."""
        done = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:  # not when it was skipped out of the queue
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            done.append(request)
        return done

    def _free_request(self, request: Request) -> Optional[dict]:
        """-> the kv_transfer_params of a request whose blocks a KV connector keeps (P/D)."""
        self.pending_tokens.pop(request.request_id, None)
        self.unsent.discard(request.request_id)
        held, params = self.remote_kv.on_finished(request) if self.remote_kv is not None else (False, None)
        if not held:
            self.kv_cache_manager.free(request)
        self.kv_cache_manager.drop_swapped(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_kv_transfers(self) -> bool:
        """Finished requests whose blocks wait for a KV transfer to end (P/D): the engine core
        keeps stepping for them."""
        return self.remote_kv is not None and self.remote_kv.has_work()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens, self.config.max_num_batched_tokens)
        self._fork_ready_parents()
        if self.config.scheduling_policy == "priority":
            self._order_by_priority()
            self._preempt_for_waiting(step)
        num_preempted = len(step.preempted)
        self._schedule_running(step)
        if len(step.preempted) == num_preempted:  # no admission while we are short of blocks
            self._schedule_waiting(step)
        return self._make_output(step)

    def _order_by_priority(self) -> None:
        """Both queues in (priority, arrival) order. The sorts are stable: a search's beams
        (one key) stay together, and a preempted request stays ahead of its equals."""
        self.running.sort(key=Request.priority_key)
        self.waiting = deque(sorted(self.waiting, key=Request.priority_key))

    def _preempt_for_waiting(self, step: _Step) -> None:
        """The best waiting unit, when its first chunk cannot get blocks or its sequences no slot,
        preempts the lowest-priority running units while they rank below it, until it fits.
        The block count ignores prefix hits (they only lower it)."""
        if not self.waiting or self.waiting[0].status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return  # a grammar still compiling, a remote KV load: the head could not start anyway
        kv, head = self.kv_cache_manager, self.waiting[0]
        unit = _unit_at(self.waiting, 0)
        width = sum(r.get_max_num_running_seqs() for r in unit)
        blocks = sum(kv.num_blocks_to_allocate(r, min(self._num_tokens_to_compute(r), step.budget)) for r in unit)
        preempted = False
        while self.running and self.running[-1].priority_key() > head.priority_key():
            num_seqs = sum(r.get_max_num_running_seqs() for r in self.running)
            loras = {r.lora_int_id for r in self.running} - {0}
            if (
                num_seqs + width <= self.config.max_num_seqs
                and blocks <= kv.num_free_blocks()
                and lora_fits(head.lora_int_id, loras, self.config.max_loras)
            ):
                break
            victims = _unit_at(self.running, len(self.running) - 1)
            del self.running[-len(victims) :]
            for victim in reversed(victims):
                self._preempt(victim)
            step.preempted.extend(victims)
            preempted = True
        if preempted:  # the victims were pushed to the front: back behind the head, by rank
            self.waiting = deque(sorted(self.waiting, key=Request.priority_key))

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, oldest first, a unit at a time (a request, or a search's beams)."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            unit = _unit_at(self.running, i)
            trim_spec_tokens(unit, step.budget, self._num_tokens_to_compute)
            plan = self._plan_tokens(unit, step.budget, step)
            # Room for the whole unit, or preempt the newest units; units are contiguous and
            # taken from the end, so a victim is never one scheduled earlier in this step.
            while (allocated := self._allocate_unit(plan)) is None:
                victims = _unit_at(self.running, len(self.running) - 1)
                del self.running[-len(victims) :]
                for victim in reversed(victims):  # pushed to the front in their order
                    self._preempt(victim)
                step.preempted.extend(victims)
                if victims[0] is unit[0]:
                    break
            if allocated is None:
                return
            for (request, n), blocks in zip(plan, allocated):
                if request.request_id in self.unsent:
                    self.unsent.discard(request.request_id)
                    step.new_reqs.append(request)
                else:
                    step.cached_reqs.append(request)
                step.num_scheduled[request.request_id] = n
                step.new_block_ids[request.request_id] = [b.block_id for b in blocks]
                step.new_block_ids_by_group[request.request_id] = self.kv_cache_manager.new_block_ids_by_group(blocks)
                step.budget -= n
                if request.spec_token_ids:  # trimmed to the budget: all of them are scheduled
                    step.spec[request.request_id], request.spec_token_ids = request.spec_token_ids, []
            i += len(unit)

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting units, first come first served, while sequences, blocks and budget last;
        a request whose grammar is still compiling is passed over and keeps its place."""
        skipped: list[Request] = []
        try:
            self._admit_waiting(step, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _grammar_pending(self, request: Request) -> bool:
        """True while the request's grammar compiles (WAITING_FOR_FSM); a grammar that failed to
        compile ends the request (the frontend validated the spec, so this is rare)."""
        if request.status != RequestStatus.WAITING_FOR_FSM:
            return False
        so = request.structured_output_request
        if not so.is_ready():
            return True
        request.status = RequestStatus.WAITING
        if so.error is not None:
            self.waiting.popleft()
            request.stop_reason = so.error
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self.grammar_failed.append(request)
        return False

    def _admit_waiting(self, step: _Step, skipped: list[Request]) -> None:
        kv = self.kv_cache_manager
        max_seqs = self.config.max_num_seqs
        num_seqs = sum(r.get_max_num_running_seqs() for r in self.running)
        loras = {r.lora_int_id for r in self.running} - {0}  # adapters that hold a slot
        while self.waiting and step.budget > 0:
            head = self.waiting[0]
            if self._grammar_pending(head):
                skipped.append(self.waiting.popleft())
                continue
            if head.is_finished():
                continue
            if self.remote_kv is not None:
                loading = self.remote_kv.check_waiting(head)
                if loading is None:
                    if self._release_remote_holders(head):
                        continue
                    return  # no blocks for its load
                if loading:
                    skipped.append(self.waiting.popleft())
                    continue
            if not lora_fits(head.lora_int_id, loras, self.config.max_loras):
                skipped.append(self.waiting.popleft())  # waits for a slot, keeps its place
                continue
            unit = _unit_at(self.waiting, 0)
            # A request counts as every sequence it will fork into (n siblings, beams).
            width = sum(r.get_max_num_running_seqs() for r in unit)
            if num_seqs + width > max_seqs:
                return
            # A search's beams come back together: room for all of them at their full
            # prompt first (prefix hits only lower that), so no beam is left behind.
            if (
                len(unit) > 1
                and sum(kv.num_blocks_to_allocate(r, self._num_tokens_to_compute(r)) for r in unit)
                > kv.num_free_blocks()
            ):
                return
            if self._admit(unit[0], step) is None:
                if self._release_remote_holders(head):
                    continue
                return  # nothing changed
            if head.lora_int_id:
                loras.add(head.lora_int_id)
            for request in unit[1:]:
                if self._admit(request, step, with_unit=True) is None:
                    raise RuntimeError(f"KV cache: no room for beam {request.request_id} after the check")
            num_seqs += width

    def _release_remote_holders(self, head: Request) -> bool:
        """The head cannot start and nothing runs to free blocks: loaded requests waiting behind it
        give theirs back (RemoteKV.release_loaded). True when some did: try the head again."""
        if self.remote_kv is None or self.running:
            return False
        released = self.remote_kv.release_loaded(self.waiting, head)
        self.num_preemptions += released
        return released > 0

    def _make_output(self, step: _Step) -> SchedulerOutput:
        """The step as the runner reads it; the scheduled tokens count as computed from here."""
        kv = self.kv_cache_manager
        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    r.request_id,
                    list(r.all_token_ids),
                    r.num_prompt_tokens,
                    r.sampling_params,
                    kv.get_block_ids(r.request_id),
                    r.num_computed_tokens,
                    r.lora_request,
                    block_ids_by_group=kv.get_block_ids_by_group(r.request_id),
                    mm_inputs=r.mm_inputs,
                )
                for r in step.new_reqs
            ],
            scheduled_cached_reqs=[
                CachedRequestData(
                    r.request_id,
                    step.new_block_ids[r.request_id],
                    r.num_computed_tokens,
                    self.pending_tokens.pop(r.request_id, []),
                    step.new_block_ids_by_group[r.request_id],
                )
                for r in step.cached_reqs
            ],
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            preempted_req_ids={r.request_id for r in step.preempted},
            finished_req_ids=self.finished_req_ids,
            blocks_to_copy=kv.take_pending_copies(),
            scheduled_spec_decode_tokens=step.spec,
        )
        out.blocks_to_swap_out, out.blocks_to_swap_in = kv.take_pending_swaps()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out, self.requests, kv.get_block_ids)
        self.finished_req_ids = set()
        # The tokens are as good as computed once scheduled: the next step schedules the rest.
        for req_id, n in step.num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            # Constrained and sampling this step (a prefill chunk or a forking parent does not).
            if request.structured_output_request is not None and request.num_computed_tokens >= request.num_tokens:
                out.structured_output_request_ids.append(req_id)
        return out

    def _trim_to_encoder(self, request: Request, n: int, step: _Step) -> int:
        """n, or fewer so that the images the tokens start fit the step's encoder budget."""
        if not request.mm_inputs or n <= 0:
            return n
        n, used = trim_to_encoder_budget(
            request.mm_inputs, request.num_computed_tokens, n, step.encoder_budget, self.config.disable_chunked_mm_input
        )
        step.encoder_budget -= used
        return n

    def _plan_tokens(self, unit: list[Request], budget: int, step: _Step) -> list[tuple[Request, int]]:
        """The tokens each running request of a unit computes this step, within the budget
        (without chunked prefill, a request whose remaining prompt does not fit waits)."""
        if len(unit) == 1:  # the common case
            need = self._num_tokens_to_compute(unit[0])
            n = self._trim_to_encoder(unit[0], self._chunk(unit[0], min(need, budget)), step)
            return [(unit[0], n)] if n > 0 and (n == need or self.config.chunked_prefill) else []
        plan = []
        for request in unit:
            need = self._num_tokens_to_compute(request)
            n = self._chunk(request, min(need, budget))
            if n <= 0 or (n < need and not self.config.chunked_prefill):
                continue  # nothing to compute (a beam waiting for its siblings), or no room
            plan.append((request, n))
            budget -= n
        return plan

    def _allocate_unit(self, plan: list[tuple[Request, int]]) -> Optional[list[list]]:
        """New blocks for every (request, tokens) of a unit's plan, all or nothing (None)."""
        kv = self.kv_cache_manager
        if len(plan) > 1 and sum(kv.num_blocks_to_allocate(r, n) for r, n in plan) > kv.num_free_blocks():
            return None
        allocated = []
        for request, n in plan:
            blocks = kv.allocate_slots(request, self._with_lookahead(request, n))
            if blocks is None:
                if len(plan) > 1:  # counted above: allocate_slots takes no more than that
                    raise RuntimeError(f"KV cache: no room for beam {request.request_id} after the check")
                return None
            allocated.append(blocks)
        return allocated

    def _admit(self, request: Request, step: _Step, with_unit: bool = False) -> Optional[int]:
        """Move the waiting request at the front to running with the tokens the budget allows
        (prefix-cache hits first), scheduled into `step` -> the tokens scheduled; None, changing
        nothing, when the blocks (or, without chunked prefill, the budget) are not there. `with_unit`: a beam
        following its search's first admitted beam, which may get no tokens this step."""
        kv = self.kv_cache_manager
        swapped = kv.is_swapped(request)
        # A request that holds blocks already (swapped out, or its KV loaded from a remote
        # prefill) takes no prefix hits.
        hits, num_hit_tokens = ([], 0) if swapped or request.num_computed_tokens else kv.get_computed_blocks(request)
        n = self._num_tokens_to_compute(request) - num_hit_tokens
        if n > step.budget and not self.config.chunked_prefill:
            if not with_unit:
                return None
            n = 0
        n = self._chunk(request, min(n, step.budget), num_hit_tokens)
        if request.mm_inputs and n:  # the tokens after the prefix hits
            request.num_computed_tokens += num_hit_tokens
            n = self._trim_to_encoder(request, n, step)
            request.num_computed_tokens -= num_hit_tokens
            if n == 0 or (
                n < self._num_tokens_to_compute(request) - num_hit_tokens and not self.config.chunked_prefill
            ):
                return None  # the whole prompt runs in one step or waits; so does a whole image
        blocks = (
            kv.swap_in(request, n)
            if swapped
            else kv.allocate_slots(request, self._with_lookahead(request, n, num_hit_tokens), hits)
        )
        if blocks is None:
            return None
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            kv.stats.queries += request.num_tokens
            kv.stats.hits += num_hit_tokens
        request.num_computed_tokens += num_hit_tokens
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if n == 0:
            # A parallel-sampling parent whose shared prefix is all cached forks next step; a
            # beam left without budget is sent to the runner when it is first scheduled.
            if with_unit:
                self.unsent.add(request.request_id)
            return 0
        step.new_reqs.append(request)
        step.num_scheduled[request.request_id] = n
        step.budget -= n
        return n

    def _chunk(self, request: Request, n: int, num_hit_tokens: int = 0) -> int:
        """n tokens from the request's computed ones (and its hits), or fewer under chunked
        prefill so that the chunk ends where a recurrent model keeps a state snapshot
        (KVCacheManager.prefill_chunk_end)."""
        if not self.config.chunked_prefill or n <= 0:
            return n
        return self.kv_cache_manager.prefill_chunk_end(request, request.num_computed_tokens + num_hit_tokens, n)

    def _with_lookahead(self, request: Request, n: int, num_hit_tokens: int = 0) -> int:
        """n and the draft model's lookahead slots (none past max_model_len; the draft
        proposer stays inside the blocks a row has, so fewer slots only mean fewer drafts)."""
        if not self.config.num_lookahead_tokens or n == 0:
            return n
        room = self.config.max_model_len - request.num_computed_tokens - num_hit_tokens
        return max(min(n + self.config.num_lookahead_tokens, room), n)

    def _num_tokens_to_compute(self, request: Request) -> int:
        """A parallel-sampling parent computes its prompt but the last token; the siblings it
        forks into compute that token each (sharing every block before it)."""
        # Drafts follow the last token; so do the tokens of steps in flight (async scheduling).
        end = request.num_tokens + request.num_output_placeholders + len(request.spec_token_ids)
        if request.sampling_params.num_samples > 1:
            end = request.num_prompt_tokens - 1
        return end - request.num_computed_tokens

    def _fork_ready_parents(self) -> None:
        """Parents whose shared prefix is computed become their siblings, in their place."""
        for parent in [
            r
            for r in self.running
            if r.sampling_params.num_samples > 1 and r.num_computed_tokens == r.num_prompt_tokens - 1
        ]:
            at = self.running.index(parent)
            children = [parent.make_child(i) for i in range(parent.sampling_params.num_samples)]
            # A recurrent state is copied, not shared: siblings without room for theirs start
            # over from the prompt, at the front of the waiting queue.
            kv = self.kv_cache_manager
            fits = next(k for k in range(len(children), -1, -1) if kv.can_fork(parent, k))
            for child in children:
                self.requests[child.request_id] = child
            for child in children[:fits]:
                kv.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens = parent.num_cached_tokens
                child.status = RequestStatus.RUNNING
            self.waiting.extendleft(reversed(children[fits:]))
            children = children[:fits]
            # Each sibling carries the prompt's logprobs with its first token (a stream echoes
            # them in its first chunk); the frontend keeps one copy, on the parent.
            shared = parent.take_prompt_logprobs()
            for child in children:
                child.prompt_logprobs = shared
            self.running[at : at + 1] = children
            self._free_request(parent)
            self.unsent.update(c.request_id for c in children)

    # ------------------------------------------------------------ external tokens (beam search)
    def append_token(self, req_id: str, token_id: int) -> None:
        """Append a token chosen outside the core to a request that awaits one."""
        request = self.requests[req_id]
        request.append_output_token_ids([token_id])
        if request.status == RequestStatus.RUNNING and req_id not in self.unsent:
            self.pending_tokens.setdefault(req_id, []).append(token_id)

    def fork_request(self, parent_id: str, child_id: str, token_id: int) -> Request:
        """A new request continuing `parent_id` with one more token, over the parent's blocks."""
        parent = self.requests[parent_id]
        if child_id in self.requests:
            raise ValueError(f"request_id {child_id!r} is already in use")
        child = Request(
            child_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id, parent.arrival_time
        )
        child.max_tokens, child.extra_keys = parent.max_tokens, parent.extra_keys
        child.mm_inputs = parent.mm_inputs
        child.group_id, child.priority = parent.group_id, parent.priority
        child.append_output_token_ids(parent.output_token_ids + [token_id])
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child_id] = child
        if parent.status == RequestStatus.RUNNING and self.kv_cache_manager.can_fork(parent):
            self.kv_cache_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
            self.unsent.add(child_id)
        else:  # the parent was preempted (with its whole search), or no room for a copy of its
            # recurrent state: the child computes from scratch
            self.waiting.appendleft(child)
        return child

    def _preempt(self, request: Request) -> None:
        """Swap the request's KV out when asked to and there is room; else recompute later."""
        swapped = self.config.preemption_mode == "swap" and self.kv_cache_manager.swap_out(request)
        self.num_swaps += swapped
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request, recompute=not swapped)

    def _requeue(self, request: Request, recompute: bool) -> None:
        """Back to the front of the waiting queue, sent to the runner in full when it resumes;
        `recompute`: its blocks go back and its tokens are computed again."""
        self.unsent.discard(request.request_id)
        self.pending_tokens.pop(request.request_id, None)  # resumed requests carry all tokens
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        if recompute:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    # ------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = [
            EngineCoreOutput(r.request_id, [], FinishReason.ABORT.value, r.stop_reason) for r in self.grammar_failed
        ]
        self.grammar_failed = []
        if runner_output.encoder_stats is not None:
            self.mm_cache_queries += runner_output.encoder_stats[0]
            self.mm_cache_hits += runner_output.encoder_stats[1]
        logprobs = runner_output.logprobs
        for req_id, chunk in (runner_output.prompt_logprobs or {}).items():
            request = self.requests.get(req_id)
            if request is not None:
                request.add_prompt_logprobs(chunk)
        pooled = runner_output.pooler_output
        if self.remote_kv is not None:
            self._update_kv_transfers(runner_output.kv_connector_output)
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if pooled is not None and pooled[row] is not None and request is not None and not request.is_finished():
                outputs.append(self._finish_pooled(request, pooled[row]))
                continue
            new_ids = runner_output.sampled_token_ids[row]
            if request is None or not new_ids or request.is_finished():
                continue  # mid-prefill, or ended (aborted) while the step ran
            if request.sampling_params.external_tokens:
                # Beam search: report the logprobs; the caller appends the chosen token.
                outputs.append(EngineCoreOutput(req_id, [], new_logprobs=logprobs[row]))
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:  # the rejected drafts' slots are computed again (overwritten) later
                request.num_computed_tokens -= len(drafts) + 1 - len(new_ids)
                self.spec_decoding_stats.observe(len(drafts), len(new_ids) - 1)
            new_ids, finished = self._append_checked(request, new_ids)
            so = request.structured_output_request
            if so is not None and not so.grammar.accept_tokens(new_ids):  # never when the mask applied
                request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, "grammar refused a token"
                finished = True
            elif not finished and so is not None and so.grammar.is_terminated():  # e.g. with ignore_eos
                request.status, finished = RequestStatus.FINISHED_STOPPED, True
            spec = runner_output.spec_token_ids
            if spec is not None and not finished:
                request.spec_token_ids = self._bounded_drafts(request, spec[row])
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_ids,
                    finish_reason=request.get_finished_reason().value if finished else None,
                    stop_reason=request.stop_reason,
                    new_logprobs=logprobs[row][: len(new_ids)] if logprobs is not None and logprobs[row] else None,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=request.take_prompt_logprobs(),
                )
            )
            if finished:  # async scheduling: it may have been preempted since the step began
                (self.running if request in self.running else self.waiting).remove(request)
                outputs[-1].kv_transfer_params = self._free_request(request)
        return outputs

    def _update_kv_transfers(self, kv_connector_output) -> None:
        """Blocks fetched from this instance go back; requests whose KV load failed end."""
        failed = self.remote_kv.update(kv_connector_output)
        if failed:
            why = dict(failed)
            for request in self.finish_requests(why, RequestStatus.FINISHED_ABORTED):
                self.kv_load_failures.append((request.request_id, why[request.request_id]))

    def _finish_pooled(self, request: Request, vector: list[float]) -> EngineCoreOutput:
        """A pooling request ends with its prompt: its vector is its only output."""
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason="stop",
            pooled=vector,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _append_checked(self, request: Request, new_ids: list[int]) -> tuple[list[int], bool]:
        """Append the step's tokens one by one (several with speculation) until one ends the
        request: the tokens after it are dropped -> (tokens kept, finished)."""
        for i, token in enumerate(new_ids):
            request.append_output_token_ids([token])
            if self._check_stop(request):
                return new_ids[: i + 1], True
        return new_ids, False

    def _bounded_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts that can still be used: the step adds at most len(drafts) + 1 tokens, within
        max_tokens and max_model_len."""
        room = self.config.max_model_len - request.num_tokens - 1  # the bonus token's slot too
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return list(drafts[: max(room, 0)])

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if request.num_tokens >= self.config.max_model_len or (
            request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def get_request(self, req_id: str) -> Optional[Request]:
        return self.requests.get(req_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (vLLM's `reset_prefix_cache`): the next requests
        compute their prompts in full. Refused (False) while requests hold blocks, whose hashes
        their later blocks chain from."""
        if self.requests:
            return False
        self.kv_cache_manager.block_pool.reset_prefix_cache()
        return True

    # ------------------------------------------------------------ after a failed step (engine/step_failures.py)
    def recompute_all(self, swapped_out: Iterable[str] = ()) -> None:
        """Every running request back to the front of the waiting queue, to be computed again
        from its tokens; those in `swapped_out` lose their swapped copy too (its copy may
        never have run), and the prefix cache is emptied. The runner forgets every row."""
        kv = self.kv_cache_manager
        for request in reversed(self.running):
            self._requeue(request, recompute=True)
        self.running = []
        for req_id in swapped_out:
            request = self.requests.get(req_id)
            if request is not None and kv.is_swapped(request):
                kv.drop_swapped(request)
                request.num_computed_tokens = 0
        kv.block_pool.reset_prefix_cache()

    def schedule_alone(self, request: Request) -> SchedulerOutput:
        """A step for `request` alone (with the siblings it forks into, or the other beams of
        its search: a unit is never split), every other request left where it is,
        unscheduled: the engine core running a suspect by itself."""
        running, waiting = self.running, self.waiting
        group = request.group_id

        def mine(r: Request) -> bool:
            return r is request if group is None else r.group_id == group

        self.running = [r for r in running if mine(r)]
        self.waiting = deque(r for r in waiting if mine(r))
        try:
            return self.schedule()
        finally:
            self.running = [r for r in running if not mine(r)] + self.running
            self.waiting = self.waiting + deque(r for r in waiting if not mine(r))


def lora_fits(lora_int_id: int, loras: set[int], max_loras: int) -> bool:
    """Whether a request of adapter lora_int_id (0: none) can run beside the adapters of
    `loras` without more distinct adapters in a step than --max-loras."""
    return not lora_int_id or lora_int_id in loras or len(loras) < max_loras


def _unit_at(queue, i: int) -> list[Request]:
    """The request at index i with the other beams of its search next to it: what is preempted
    and admitted as one. A search's beams stay contiguous in both queues (forks go next to
    their parent, preemption and admission move whole units)."""
    group = queue[i].group_id
    if group is None:
        return [queue[i]]
    lo, hi = i, i + 1
    while lo > 0 and queue[lo - 1].group_id == group:
        lo -= 1
    while hi < len(queue) and queue[hi].group_id == group:
        hi += 1
    return [queue[j] for j in range(lo, hi)]
