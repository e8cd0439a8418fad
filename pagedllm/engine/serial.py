"""The messages between the API server process and the EngineCore process, in one place.

Everything crosses the process boundary as msgpack of plain values: a SamplingParams or a
Request becomes a dict / list and is rebuilt on the other side. Each message is a map with
a type tag "t":

  server -> core                               core -> server
  {"t": "add", "r": [encoded Request, ...]}     {"t": "ready", "num_blocks": int, "pid": int}
  {"t": "beam", "r": encoded Request,           {"t": "out", "o": [encoded EngineCoreOutput],
   "w": width, "lp": length_penalty,              "s": stats, "q": [[req_id, queue_s], ...],
   "eos": int | None}                             "b": [encoded beam result, ...] (optional)}
  {"t": "abort", "ids": [req_id, ...]}          {"t": "stats", "s": stats}
  {"t": "util", "id": int, "m": name,           {"t": "util", "id": int, "r": result, "e": error}
   "a": [args]}                                 {"t": "error", "exc": name, "msg": str}  (dying)
  {"t": "shutdown"}

"f" (optional) on an "out" message: [[req_id, message, client_error], ...], the requests a
failed step ended (engine/step_failures.py); a beam search's by the search's id.

"beam" starts a beam search in the core (engine/beam_search.py); its beams never leave the
core: one beam result for the search's request id comes back when it ends (or at once, with
an error, when the core refuses it). An "abort" of that id ends the search.

stats: {"running", "waiting", "kv_usage", "used_blocks", "num_blocks", "preemptions",
"num_added"}: the scheduler's state after the step (or after an abort) that sent it.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

import msgpack

from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSequence
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

_SP_FIELDS = tuple(f.name for f in fields(SamplingParams))


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # strict_map_key=False: logit_bias maps int token ids.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------- SamplingParams
def encode_sampling_params(p: SamplingParams) -> dict:
    d = {name: getattr(p, name) for name in _SP_FIELDS}
    d["all_stop_token_ids"] = sorted(p.all_stop_token_ids)
    return d


def decode_sampling_params(d: dict) -> SamplingParams:
    d = dict(d)
    all_stop = d.pop("all_stop_token_ids", None)
    p = SamplingParams(**{k: v for k, v in d.items() if k in _SP_FIELDS})
    if all_stop is not None:
        p.all_stop_token_ids = set(all_stop)
    return p


# ---------------------------------------------------------------- Request
def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def encode_request(r: Request) -> list:
    """A request as the Processor made it (nothing computed yet)."""
    return [r.request_id, r.prompt_token_ids, encode_sampling_params(r.sampling_params),
            r.eos_token_id, r.arrival_time, r.max_tokens, list(getattr(r, "extra_keys", ()))]


def decode_request(v: list) -> Request:
    req_id, prompt_ids, sp, eos, arrival, max_tokens, extra_keys = v
    r = Request(req_id, prompt_ids, decode_sampling_params(sp), eos_token_id=eos, arrival_time=arrival)
    r.max_tokens = max_tokens
    if extra_keys:
        r.extra_keys = _tuples(extra_keys)
    return r


# ---------------------------------------------------------------- EngineCoreOutput
def encode_output(o: EngineCoreOutput) -> list:
    lps = None
    if o.new_logprobs is not None:
        lps = [None if e is None else [list(e[0]), [float(x) for x in e[1]], int(e[2])]
               for e in o.new_logprobs]
    return [o.req_id, list(o.new_token_ids), o.finish_reason, o.stop_reason, lps, o.num_cached_tokens]


def decode_output(v: list) -> EngineCoreOutput:
    req_id, ids, finish, stop, lps, cached = v
    if lps is not None:
        lps = [None if e is None else (e[0], e[1], e[2]) for e in lps]
    return EngineCoreOutput(req_id=req_id, new_token_ids=ids, finish_reason=finish,
                            stop_reason=stop, new_logprobs=lps, num_cached_tokens=cached)


# ---------------------------------------------------------------- beam search results
def encode_beam_output(o: BeamSearchOutput, error: Optional[str] = None) -> list:
    seqs = [[list(h.tokens), float(h.cum_logprob), float(h.score), h.finish_reason] for h in o.sequences]
    return [o.request_id, list(o.prompt_token_ids), seqs, o.num_cached_tokens, error]


def decode_beam_output(v: list) -> tuple[BeamSearchOutput, Optional[str]]:
    """The result, and the core's error message when it refused the search."""
    req_id, prompt_ids, seqs, cached, error = v
    out = BeamSearchOutput(prompt_ids, [BeamSequence(t, c, s, finish_reason=f) for t, c, s, f in seqs],
                           req_id, cached)
    return out, error
