"""Beam search over the engine core: beams are core requests that share blocks.

Each live beam reports the log-probabilities of its next token (the core appends nothing:
`external_tokens`); the BeamSearchDriver picks the best continuations over all beams of a
prompt, forks each chosen one from its beam (the child shares every block, and copy-on-write
gives it its own partly filled last block), and aborts the beams that were not kept. Selection
follows transformers' beam search (early_stopping=False): the top 2k candidates by
cumulative logprob; those among the first k that end (EOS or the length limit) become
hypotheses scored sum_logprobs / generated_len ** length_penalty; the k best non-ending
candidates run on; the search ends when no running beam can beat the worst kept hypothesis.

The driver is step-driven: whoever steps the core hands it the step's outputs. The offline
`beam_search()` below and the server's engine-core process (core_proc.py) both use it, so
searches and normal requests run interleaved in the same steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

_ABORTED = RequestStatus.FINISHED_ABORTED
_NEG = -1.0e9
MAX_BEAM_WIDTH = 10  # 2k logprobs per beam, and the sampler reports at most 20


@dataclass
class BeamSequence:
    tokens: list[int]  # generated tokens (EOS included when the beam ended on it)
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty
    text: str = ""
    finish_reason: str = "length"  # "stop": ended on EOS
    logprobs: list[float] = field(default_factory=list)  # each token's (raw logits), sum = cum_logprob


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first
    request_id: str = ""
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class _Beam:
    req_id: str
    tokens: list[int]
    score: float
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Search:
    request_id: str
    prompt: list[int]
    width: int
    max_len: int  # prompt + max_tokens (transformers' max_length)
    length_penalty: float
    eos: Optional[int]
    running: list[_Beam]
    finished: list[BeamSequence] = field(default_factory=list)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    cur_len: int = 0
    improvable: bool = True
    done: bool = False
    num_cached_tokens: int = 0


# ---------------------------------------------------------------- shared with the server
def check_beam_args(beam_width, max_tokens, length_penalty) -> None:
    """ValueError naming the argument (before anything reaches the core)."""
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or not (1 <= beam_width <= MAX_BEAM_WIDTH):
        raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {beam_width!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (
        not isinstance(length_penalty, (int, float))
        or isinstance(length_penalty, bool)
        or length_penalty != length_penalty
        or abs(length_penalty) == float("inf")
    ):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")


def beam_params(beam_width: int, max_tokens: int) -> SamplingParams:
    """The params of a search's first beam: it reports its top 2k next tokens (logprobs of the
    raw logits) and the driver, not the core, decides when it stops."""
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=2 * beam_width, external_tokens=True, ignore_eos=True
    )


def detokenize(tokenizer, out: BeamSearchOutput) -> BeamSearchOutput:
    for h in out.sequences:
        h.text = tokenizer.decode(h.tokens, skip_special_tokens=True)
    return out


# ---------------------------------------------------------------- the driver
class BeamSearchDriver:
    """Beam searches over an EngineCore, advanced by the outputs of each core step."""

    def __init__(self, core) -> None:
        self.core = core
        self.sched = core.scheduler
        self.searches: dict[str, _Search] = {}  # by the search's (the client's) request id
        self.by_req: dict[str, _Search] = {}  # by live beam id
        self._ids = itertools.count()

    def add(self, request: Request, width: int, length_penalty: float = 1.0, eos: Optional[int] = None) -> None:
        """Start a search for a validated request (beam_params); its id names the search and
        its beams are `{id}#{n}`. eos None: run to max_tokens."""
        search_id = request.request_id
        if search_id in self.searches:
            raise ValueError(f"request_id {search_id!r} is already in use")
        if request.sampling_params.logprobs != 2 * width or not request.sampling_params.external_tokens:
            raise ValueError("a beam search request needs beam_params(width, ...)")
        prompt = request.prompt_token_ids
        s = _Search(
            search_id,
            prompt,
            width,
            len(prompt) + request.max_tokens,
            float(length_penalty),
            eos,
            [],
            cur_len=len(prompt),
        )
        request.request_id = self._beam_id(search_id)  # not yet known to the scheduler
        request.group_id, request.fork_width = search_id, width  # admitted as all its beams
        self.core.add_request(request)  # ValueError (e.g. a duplicate id) leaves nothing behind
        s.running = [_Beam(request.request_id, [], 0.0)]
        self.searches[search_id] = s
        self.by_req[request.request_id] = s

    def owns(self, req_id: str) -> bool:
        return req_id in self.by_req

    def has_searches(self) -> bool:
        return bool(self.searches)

    def on_outputs(self, outputs: Iterable) -> list[BeamSearchOutput]:
        """Take the beams' reports from a step's outputs (others are ignored), advance each
        search whose beams have all reported; returns the searches that ended (text empty)."""
        advanced = {}
        for out in outputs:
            s = self.by_req.get(out.req_id)
            if s is not None and out.new_logprobs:
                ids_, lps, _ = out.new_logprobs[0]
                s.reports[out.req_id] = list(zip(ids_[1:], lps[1:]))  # the top 2k (sampled first)
                advanced[s.request_id] = s
        ended = []
        for s in advanced.values():
            if len(s.reports) == len(s.running):
                self._advance(s)
            if s.done:
                del self.searches[s.request_id]
                ended.append(
                    BeamSearchOutput(
                        s.prompt,
                        sorted(s.finished, key=lambda h: h.score, reverse=True),
                        s.request_id,
                        s.num_cached_tokens,
                    )
                )
        return ended

    def abort(self, search_id: str) -> bool:
        """End a search: its live beams are aborted (their blocks go back). -> whether it ran."""
        s = self.searches.pop(search_id, None)
        if s is None:
            return False
        self._drop(s, s.running)
        s.running = []
        return True

    # ------------------------------------------------------------ internals
    def _beam_id(self, search_id: str) -> str:
        return f"{search_id}#{next(self._ids)}"

    def _drop(self, s: _Search, beams: list[_Beam]) -> None:
        ids = [b.req_id for b in beams]
        self.sched.finish_requests(ids, _ABORTED)
        for rid in ids:
            self.by_req.pop(rid, None)
            s.reports.pop(rid, None)

    def _advance(self, s: _Search) -> None:
        k, length_penalty = s.width, s.length_penalty
        # Candidates over all beams, best first (ties: beam order, then token rank).
        cands = [
            (beam.score + lp, bi, tid, lp) for bi, beam in enumerate(s.running) for tid, lp in s.reports[beam.req_id]
        ]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * k]
        s.reports.clear()
        at_limit = s.cur_len + 1 >= s.max_len
        hits = [at_limit or tid == s.eos for _, _, tid, _ in cands]
        # Hypotheses: ending candidates among the first k, unless no improvement is possible.
        gen_len = s.cur_len + 1 - len(s.prompt)
        if s.improvable:
            for (score, bi, tid, lp), hit in zip(cands[:k], hits[:k]):
                if hit:
                    s.finished.append(
                        BeamSequence(
                            s.running[bi].tokens + [tid],
                            score,
                            score / gen_len**length_penalty,
                            finish_reason="stop" if tid == s.eos else "length",
                            logprobs=s.running[bi].logprobs + [lp],
                        )
                    )
            s.finished = sorted(s.finished, key=lambda h: h.score, reverse=True)[:k]
        if s.cur_len == len(s.prompt):  # the first beam has looked its prompt up by now
            first = self.sched.get_request(s.running[0].req_id)
            s.num_cached_tokens = max(first.num_cached_tokens, 0) if first is not None else 0
        # The next running beams: the k best, ending ones pushed to the back.
        order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if hits[i] else 0.0)))[:k]
        new_running = []
        for i in order:
            score, bi, tid, lp = cands[i]
            parent = s.running[bi]
            child_id = self._beam_id(s.request_id)
            self.sched.fork_request(parent.req_id, child_id, tid)
            new_running.append(
                _Beam(child_id, parent.tokens + [tid], score + (_NEG if hits[i] else 0.0), parent.logprobs + [lp])
            )
            self.by_req[child_id] = s
        self._drop(s, s.running)
        s.running = new_running
        s.cur_len += 1
        # Can a running beam still beat the worst kept hypothesis? (transformers' heuristic)
        best_possible = s.running[0].score / (s.cur_len - len(s.prompt)) ** length_penalty
        worst = min(h.score for h in s.finished) if len(s.finished) == k else _NEG
        s.improvable = s.improvable and best_possible > worst
        if not s.improvable or all(hits):
            s.done = True
            self._drop(s, s.running)
            s.running = []


# ---------------------------------------------------------------- offline
def beam_search(
    engine, prompts, beam_width: int, max_tokens: int, length_penalty: float = 1.0, ignore_eos: bool = False
) -> list[BeamSearchOutput]:
    """Beam search per prompt on an LLMEngine, stepping its core until every search ends."""
    check_beam_args(beam_width, max_tokens, length_penalty)
    eos = None if ignore_eos else engine.processor.eos_token_id
    params = beam_params(beam_width, max_tokens)
    # Validate every prompt before any runs.
    requests = [
        engine.processor.process(f"beam-{i}", prompt, params, beam_width=beam_width)[1]
        for i, prompt in enumerate(prompts)
    ]
    ids = [r.request_id for r in requests]
    driver = BeamSearchDriver(engine.core)
    results: dict[str, BeamSearchOutput] = {}
    try:
        for request in requests:
            driver.add(request, beam_width, length_penalty, eos)
        while driver.has_searches():
            for out in driver.on_outputs(engine.core.step()):
                results[out.request_id] = out
    finally:
        for rid in ids:
            driver.abort(rid)
    return [detokenize(engine.tokenizer, results[rid]) for rid in ids]
