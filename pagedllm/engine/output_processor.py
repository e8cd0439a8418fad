"""OutputProcessor: turns the core's token outputs into RequestOutputs (text, logprobs,
finish reasons), outside the model's loop. A stop string ends a request here; the caller
then aborts it in the core. Requests with n > 1 are fanned out into n child requests
whose outputs are gathered under the parent's id."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Optional

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new, every step (streaming)
    FINAL_ONLY = 2  # once, when finished (LLM.generate)


@dataclass
class RequestStats:
    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


def logprob_dicts(entries, tokenizer) -> list[dict[int, Logprob]]:
    """The core's (ids, logprobs, rank) per position -> {token id: Logprob}, the chosen (or
    prompt) token first with its rank, then the top k ranked 1..k; the tokens decoded in one
    call."""
    entries = list(entries)
    texts = iter(tokenizer.batch_decode([[t] for ids, _, _ in entries for t in ids]))
    out = []
    for ids, lps, rank in entries:
        pos: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            text = next(texts)
            if tid not in pos:  # the chosen token may be among the top k too
                pos[tid] = Logprob(lp, rank if j == 0 else j, text)
        out.append(pos)
    return out


class ParentRequest:
    """n > 1 (or best_of > 1): the siblings' outputs are gathered into one RequestOutput; with
    best_of, the n of highest cumulative logprob are kept when all are done."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.num_samples = params.num_samples
        self.user_wants_logprobs = params.logprobs is not None
        self.outputs: list[Optional[CompletionOutput]] = [None] * self.num_samples
        self.num_finished = 0
        self.prompt_logprobs: Optional[PromptLogprobs] = None  # once, for all the siblings

    def final_outputs(self) -> list[CompletionOutput]:
        outs = list(self.outputs)
        if self.num_samples > self.n:
            outs = sorted(outs, key=lambda c: c.cumulative_logprob, reverse=True)[: self.n]
            for i, c in enumerate(outs):
                c.index = i
                if not self.user_wants_logprobs:
                    c.logprobs = c.cumulative_logprob = None
        return outs


class RequestState:
    def __init__(
        self,
        request: Request,
        prompt: Optional[str],
        tokenizer,
        kind: OutputKind,
        parent: Optional[ParentRequest],
        index: int,
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params: SamplingParams = request.sampling_params
        self.kind = kind
        self.parent = parent
        self.index = index
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, self.params)
        self.output_token_ids: list[int] = []
        self.num_sent_tokens = 0
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if self.params.logprobs is not None else None
        self.num_cached_tokens = 0
        self.stats = RequestStats(arrival_time=request.arrival_time)
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.prompt_logprobs_sent = False  # DELTA: only the first output carries them

    def add_logprobs(self, entries) -> None:
        self.logprobs.extend(logprob_dicts(entries, self.tokenizer))
        for _, lps, _ in entries:
            self.cumulative_logprob += lps[0]

    def set_prompt_logprobs(self, entries) -> None:
        """vLLM's shape: None for the first prompt token (nothing precedes it), then a dict per
        token; a sibling's go to its parent, once."""
        holder = self.parent if self.parent is not None else self
        if holder.prompt_logprobs is None:
            holder.prompt_logprobs = [None] + logprob_dicts(entries, self.tokenizer)

    def take_prompt_logprobs(self) -> Optional[PromptLogprobs]:
        holder = self.parent if self.parent is not None else self
        if self.kind != OutputKind.DELTA:
            return holder.prompt_logprobs
        if self.prompt_logprobs_sent or holder.prompt_logprobs is None:
            return None
        self.prompt_logprobs_sent = True
        return holder.prompt_logprobs

    def make_completion(self, finished: bool) -> CompletionOutput:
        delta = self.kind == OutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        ids = self.output_token_ids[self.num_sent_tokens :] if delta else list(self.output_token_ids)
        lps = None
        if self.logprobs is not None:
            lps = self.logprobs[self.num_sent_tokens :] if delta else list(self.logprobs)
        self.num_sent_tokens = len(self.output_token_ids)
        return CompletionOutput(
            self.index, text, ids, self.cumulative_logprob, lps, self.finish_reason, self.stop_reason
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(self, request: Request, prompt: Optional[str], kind: OutputKind) -> None:
        """A request with several samples is tracked as its siblings (ids as the core forks them)."""
        rid = request.request_id
        if rid in self.states or rid in self.parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        num = request.sampling_params.num_samples
        if num == 1:
            self.states[rid] = RequestState(request, prompt, self.tokenizer, kind, None, 0)
            return
        parent = self.parents[rid] = ParentRequest(rid, request.sampling_params)
        # best_of needs every sibling's final score before it can choose: no streaming of it.
        kind = OutputKind.FINAL_ONLY if num > parent.n else kind
        for i in range(num):
            child = request.make_child(i)
            self.states[child.request_id] = RequestState(child, prompt, self.tokenizer, kind, parent, i)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def user_request_id(self, core_id: str) -> Optional[str]:
        """The id the caller gave for a core request (a sibling's parent's), None if unknown."""
        st = self.states.get(core_id)
        if st is not None:
            return st.parent.request_id if st.parent is not None else st.request_id
        return core_id if core_id in self.parents else None

    def abort_requests(self, req_ids) -> list[str]:
        """Drop requests (by their own or a parent's id); returns the child ids to abort in the core."""
        out = []
        for rid in req_ids:
            if rid in self.parents:
                out.append(rid)  # the core may still hold the parent, before it forks
            for cid, st in list(self.states.items()):
                if cid == rid or (st.parent is not None and st.parent.request_id == rid):
                    del self.states[cid]
                    out.append(cid)
            self.parents.pop(rid, None)
        return out

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the request outputs to hand out, and the requests a stop string ended
        (to abort in the core)."""
        now = time.time()
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in core_outputs:
            st = self.states.get(out.req_id)
            if st is None:
                continue  # aborted meanwhile
            stats = st.stats
            if stats.first_token_time is None:
                stats.first_token_time = now
                st.num_cached_tokens = out.num_cached_tokens
            stats.last_token_time = now
            if out.pooled is not None:  # a pooling request: its vector, and it is done
                del self.states[out.req_id]
                st.finish_reason = "stop"
                request_outputs.append(
                    PoolingRequestOutput(
                        st.request_id, PoolingOutput(out.pooled), st.prompt_token_ids, True, st.num_cached_tokens
                    )
                )
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            stop_str = st.detokenizer.update(out.new_token_ids, finish_reason == "stop")
            keep = len(out.new_token_ids) - st.detokenizer.tokens_after_stop  # a stop string's token ends it
            st.output_token_ids.extend(out.new_token_ids[:keep])
            if st.logprobs is not None and out.new_logprobs:
                st.add_logprobs(out.new_logprobs[:keep])
            if out.prompt_logprobs is not None:
                st.set_prompt_logprobs(out.prompt_logprobs)
            if stop_str is not None and finish_reason is None:
                finish_reason, stop_reason = "stop", stop_str
                to_abort.append(out.req_id)
            elif stop_str is not None:
                finish_reason, stop_reason = "stop", stop_str
            st.finish_reason, st.stop_reason = finish_reason, stop_reason
            finished = finish_reason is not None
            if finished:
                del self.states[out.req_id]
            ro = self._make_output(st, finished)
            if ro is not None and out.kv_transfer_params is not None:
                ro.kv_transfer_params = out.kv_transfer_params
            if ro is not None:
                request_outputs.append(ro)
        return request_outputs, to_abort

    def _make_output(self, st: RequestState, finished: bool) -> Optional[RequestOutput]:
        if st.kind == OutputKind.FINAL_ONLY and not finished:
            return None
        completion = st.make_completion(finished)
        parent = st.parent
        if parent is None:
            return RequestOutput(
                st.request_id,
                st.prompt,
                st.prompt_token_ids,
                [completion],
                finished,
                st.num_cached_tokens,
                metrics=vars(st.stats),
                prompt_logprobs=st.take_prompt_logprobs(),
            )
        parent.outputs[st.index] = completion
        if finished:
            parent.num_finished += 1
        all_done = parent.num_finished == parent.num_samples
        if all_done:
            self.parents.pop(parent.request_id, None)
        if st.kind == OutputKind.FINAL_ONLY:
            if not all_done:
                return None
            outputs = parent.final_outputs()
        elif st.kind == OutputKind.DELTA:
            outputs = [completion]
        else:
            outputs = [o for o in parent.outputs if o is not None]
        return RequestOutput(
            parent.request_id,
            st.prompt,
            st.prompt_token_ids,
            outputs,
            all_done,
            st.num_cached_tokens,
            metrics=vars(st.stats),
            prompt_logprobs=st.take_prompt_logprobs(),
        )
