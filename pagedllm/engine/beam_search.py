"""Beam search over the engine core: beams are core requests that share blocks.

Each live beam reports the log-probabilities of its next token (the core appends nothing:
`external_tokens`); this loop picks the best continuations over all beams of a prompt,
forks each chosen one from its beam (the child shares every block, and copy-on-write gives
it its own partly filled last block), and aborts the beams that were not kept. Selection
follows transformers' beam search (early_stopping=False): the top 2k candidates by
cumulative logprob; those among the first k that end (EOS or the length limit) become
hypotheses scored sum_logprobs / generated_len ** length_penalty; the k best non-ending
candidates run on; the search ends when no running beam can beat the worst kept hypothesis.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams

_ABORTED = RequestStatus.FINISHED_ABORTED
_NEG = -1.0e9


@dataclass
class BeamSequence:
    tokens: list[int]          # generated tokens (EOS included when the beam ended on it)
    cum_logprob: float
    score: float               # cum_logprob / len ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]   # best first


@dataclass
class _Beam:
    req_id: str
    tokens: list[int]
    score: float


@dataclass
class _Search:
    prompt: list[int]
    width: int
    max_len: int                     # prompt + max_tokens (transformers' max_length)
    running: list[_Beam]
    finished: list[BeamSequence] = field(default_factory=list)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    cur_len: int = 0
    improvable: bool = True
    done: bool = False


def beam_search(engine, prompts, beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                ignore_eos: bool = False) -> list[BeamSearchOutput]:
    if not isinstance(beam_width, int) or not (1 <= beam_width <= 10):
        raise ValueError(f"beam_width must be an integer in [1, 10], got {beam_width!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(length_penalty, (int, float)):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
    core, sched = engine.core, engine.core.scheduler
    eos = None if ignore_eos else engine.processor.eos_token_id
    # Each beam reports its top 2k next tokens (logprobs of the raw logits).
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2 * beam_width,
                            external_tokens=True, ignore_eos=True)
    ids = itertools.count()
    searches = []
    for prompt in prompts:   # validate every prompt before any runs
        _, request = engine.processor.process(f"beam-{next(ids)}", prompt, params)
        searches.append((request, _Search(request.prompt_token_ids, beam_width,
                                          len(request.prompt_token_ids) + max_tokens, [])))
    by_req: dict[str, _Search] = {}
    for request, s in searches:
        s.cur_len = len(s.prompt)
        s.running = [_Beam(request.request_id, [], 0.0)]
        by_req[request.request_id] = s
        core.add_request(request)
    try:
        while any(not s.done for _, s in searches):
            for out in core.step():
                s = by_req.get(out.req_id)
                if s is not None and out.new_logprobs:
                    ids_, lps, _ = out.new_logprobs[0]
                    s.reports[out.req_id] = list(zip(ids_[1:], lps[1:]))  # the top 2k (sampled first)
            for _, s in searches:
                if not s.done and len(s.reports) == len(s.running):
                    _advance(s, sched, by_req, ids, eos, length_penalty)
    finally:
        live = [b.req_id for _, s in searches for b in s.running]
        core.abort_requests(live)
    tok = engine.tokenizer
    outs = []
    for _, s in searches:
        seqs = sorted(s.finished, key=lambda h: h.score, reverse=True)
        for h in seqs:
            h.text = tok.decode(h.tokens, skip_special_tokens=True)
        outs.append(BeamSearchOutput(s.prompt, seqs))
    return outs


def _advance(s: _Search, sched, by_req, ids, eos: Optional[int], length_penalty: float) -> None:
    k = s.width
    # Candidates over all beams, best first (ties: beam order, then token rank).
    cands = [(beam.score + lp, bi, tid) for bi, beam in enumerate(s.running)
             for tid, lp in s.reports[beam.req_id]]
    cands.sort(key=lambda c: -c[0])
    cands = cands[:2 * k]
    s.reports.clear()
    at_limit = s.cur_len + 1 >= s.max_len
    hits = [at_limit or tid == eos for _, _, tid in cands]
    # Hypotheses: ending candidates among the first k, unless no improvement is possible.
    gen_len = s.cur_len + 1 - len(s.prompt)
    if s.improvable:
        for (score, bi, tid), hit in zip(cands[:k], hits[:k]):
            if hit:
                s.finished.append(BeamSequence(s.running[bi].tokens + [tid], score,
                                               score / gen_len ** length_penalty))
        s.finished = sorted(s.finished, key=lambda h: h.score, reverse=True)[:k]
    # The next running beams: the k best, ending ones pushed to the back.
    order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if hits[i] else 0.0)))[:k]
    new_running = []
    for i in order:
        score, bi, tid = cands[i]
        parent = s.running[bi]
        child_id = f"{parent.req_id.split('#')[0]}#{next(ids)}"
        sched.fork_request(parent.req_id, child_id, tid)
        new_running.append(_Beam(child_id, parent.tokens + [tid], score + (_NEG if hits[i] else 0.0)))
        by_req[child_id] = s
    old = [b.req_id for b in s.running]
    sched.finish_requests(old, _ABORTED)
    for rid in old:
        by_req.pop(rid, None)
    s.running = new_running
    s.cur_len += 1
    # Can a running beam still beat the worst kept hypothesis? (transformers' heuristic)
    best_possible = s.running[0].score / (s.cur_len - len(s.prompt)) ** length_penalty
    worst = min(h.score for h in s.finished) if len(s.finished) == k else _NEG
    s.improvable = s.improvable and best_possible > worst
    if not s.improvable or all(hits):
        s.done = True
        sched.finish_requests([b.req_id for b in s.running], _ABORTED)
        s.running = []

