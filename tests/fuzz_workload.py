"""A seeded random workload for the fuzzers (tests/engine/test_engine_fuzz.py on the engine,
tests/entrypoints/test_server_fuzz.py on the server): an engine configuration with a tiny KV cache, and a
mix of requests over the `random:tiny` model (vocabulary "w3".."w511", EOS id 2).

Everything is drawn from `random.Random(seed)`, so a seed names a case exactly. The mix covers
greedy / seeded and unseeded sampling / n / best_of / beam search / stop strings / min_tokens /
logprobs, prompt lengths from 1 to max_model_len (max_model_len - 1 and max_model_len included),
shared prefixes (prefix caching), arrivals at random steps and aborts at random steps; under
--scheduling-policy priority, a priority per request.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.sampling_params import SamplingParams

MODEL = "random:tiny"
MAX_MODEL_LEN_CAP = 64  # the reference engine's context covers every drawn configuration
FIRST_WORD = 3  # ids 0-2 are <unk>, <s>, </s>
VOCAB = 512


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration; cases are grouped by it so that engines are built rarely."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    preemption_mode: str
    num_cpu_blocks: Optional[int]
    scheduling_policy: str = "fcfs"

    def engine_kwargs(self) -> dict:
        kw = dict(vars(self))
        if self.num_cpu_blocks is None:
            del kw["num_cpu_blocks"]
        return kw

    def server_args(self) -> list[str]:
        """The same configuration as `pagedllm serve` flags (the server has no flag for the
        CPU block count: swap uses its default swap space)."""
        args = [
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--preemption-mode",
            self.preemption_mode,
            "--scheduling-policy",
            self.scheduling_policy,
        ]
        if not self.enable_chunked_prefill:
            args.append("--no-enable-chunked-prefill")
        if not self.enable_prefix_caching:
            args.append("--no-enable-prefix-caching")
        return args


@dataclass
class RequestSpec:
    rid: str
    prompt: list[int]
    arrival: int  # step (engine) or tick (server) at which it is sent
    abort_after: Optional[int]  # steps / ticks after its arrival; None: never
    params: dict = field(default_factory=dict)  # SamplingParams fields (not for beam search)
    beam_width: int = 0  # > 0: a beam search of this width
    length_penalty: float = 1.0
    max_tokens: Optional[int] = 16
    stream: bool = False  # engine: DELTA outputs; server: stream=True
    chat: bool = False  # server only: /v1/chat/completions
    priority: int = 0  # under --scheduling-policy priority: lower runs earlier

    @property
    def is_beam(self) -> bool:
        return self.beam_width > 0

    @property
    def greedy(self) -> bool:
        return not self.is_beam and self.params.get("temperature", 1.0) == 0

    @property
    def reproducible(self) -> bool:
        """Its output must equal the same request run alone (greedy, or sampled with a seed)."""
        return not self.is_beam and (self.greedy or self.params.get("seed") is not None)

    def sampling_params(self, **override) -> SamplingParams:
        return SamplingParams(**{**self.params, "max_tokens": self.max_tokens, **override})

    def describe(self) -> str:
        what = f"beam(w={self.beam_width}, lp={self.length_penalty})" if self.is_beam else repr(self.params)
        return (
            f"{self.rid}: prompt {len(self.prompt)} tokens, max_tokens {self.max_tokens}, {what}, "
            f"arrival {self.arrival}, abort_after {self.abort_after}, stream {self.stream}, chat {self.chat}, "
            f"priority {self.priority}"
        )


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def draw_engine_spec(rng: random.Random) -> EngineSpec:
    block_size = rng.choice([1, 2, 4, 4, 8, 16])
    max_model_len = rng.choice([8, 16, 24, 32, 48, 64])
    full = cdiv(max_model_len, block_size)  # blocks of one sequence at full length
    # From "one long request barely fits" to "a few fit": preemption is the normal case.
    num_gpu_blocks = max(2, int(full * rng.choice([0.5, 1, 1, 1, 1.5, 1.5, 2, 2, 3, 3, 4, 4])) + 1)
    chunked = rng.random() < 0.75
    budgets = [2, 3, 4, 8, 16, 32, 64, 128]
    if not chunked:
        budgets = [b for b in budgets if b >= max_model_len] or [max_model_len]
    mode = rng.choice(["recompute", "swap"])
    spec = EngineSpec(
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=rng.choice([1, 2, 3, 4, 4, 6, 8, 8]),
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=rng.choice(budgets),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.6,
        preemption_mode=mode,
        # A tight swap space makes swap fall back to recompute now and then.
        num_cpu_blocks=rng.choice([3, full + 1, 4 * full + 1]) if mode == "swap" else None,
    )
    # Drawn last, so that the fcfs configurations are those drawn before there was a choice.
    if rng.random() < 0.35:
        spec = dataclasses.replace(spec, scheduling_policy="priority")
    return spec


def _prompt_length(rng: random.Random, max_model_len: int) -> int:
    r = rng.random()
    if r < 0.08:
        return max_model_len  # must be refused (ValueError) or served
    if r < 0.16:
        return max_model_len - 1 or 1
    if r < 0.24:
        return 1
    return rng.randint(1, max(1, max_model_len - 1))


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


def _stop_strings(rng: random.Random) -> list[str]:
    """Strings that random output meets now and then: a digit, a word prefix ("w1" is w1,
    w10-w19, w100-w199), or a span across a word boundary ("7 w")."""

    def one():
        kind = rng.random()
        if kind < 0.3:
            return str(rng.randrange(10))
        if kind < 0.7:
            return f"w{rng.randrange(1, 60)}"
        return f"{rng.randrange(10)} w{rng.randrange(1, 10)}"

    return [one() for _ in range(rng.choice([1, 1, 2]))]


def _sampling(rng: random.Random, max_tokens: Optional[int]) -> dict:
    p: dict = {}
    kind = rng.random()
    if kind < 0.35:
        p["temperature"] = 0.0
    elif kind < 0.7:
        p.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1 << 30))
    else:
        p["temperature"] = rng.choice([0.7, 1.0])
        if rng.random() < 0.7:
            p["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.25:
        p["n"] = rng.randint(2, 4)
        if rng.random() < 0.4:
            p["best_of"] = p["n"] + rng.randint(0, 2)
    elif rng.random() < 0.1:
        p["best_of"] = rng.randint(2, 3)
    if rng.random() < 0.25:
        p["stop"] = _stop_strings(rng)
    if rng.random() < 0.25:
        cap = max_tokens if max_tokens is not None else 8
        p["min_tokens"] = rng.randint(1, cap)
    if rng.random() < 0.3:
        p["logprobs"] = rng.choice([0, 1, 3])
    return p


def draw_requests(
    rng: random.Random,
    spec: EngineSpec,
    prefix: str,
    max_requests: int = 8,
    max_arrival: int = 12,
    beam: bool = True,
    share: float = 0.4,
) -> list[RequestSpec]:
    """A case's requests, ids `{prefix}-{i}`, in arrival order; `share` of them start with a
    part of one shared prompt."""
    mml = spec.max_model_len
    shared = _words(rng, mml)  # prompts that share a prefix exercise the prefix cache
    out = []
    for i in range(rng.randint(1, max_requests)):
        n = _prompt_length(rng, mml)
        if rng.random() < share:
            k = rng.randint(1, n)
            prompt = shared[:k] + _words(rng, n - k)
        else:
            prompt = _words(rng, n)
        max_tokens = None if rng.random() < 0.1 else rng.randint(1, min(24, mml))
        req = RequestSpec(
            f"{prefix}-{i}",
            prompt,
            arrival=rng.randint(0, max_arrival),
            abort_after=rng.randint(0, 30) if rng.random() < 0.15 else None,
            stream=rng.random() < 0.4,
            chat=rng.random() < 0.3,
        )
        if beam and rng.random() < 0.15:
            req.beam_width = rng.choice([1, 2, 2, 3, 4, 5, 8])
            req.length_penalty = rng.choice([1.0, 0.6, 1.5])
            req.max_tokens = rng.randint(1, min(12, mml))
        else:
            req.max_tokens = max_tokens
            req.params = _sampling(rng, max_tokens)
            if req.chat:  # OpenAI's chat completions have no best_of
                req.params.pop("best_of", None)
        out.append(req)
    if spec.scheduling_policy == "priority":  # drawn last: the rest of the case is as under fcfs
        for req in out:
            req.priority = rng.choice([-5, 0, 0, 1, 3, 10])
    out.sort(key=lambda r: r.arrival)
    return out
