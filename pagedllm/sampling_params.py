"""SamplingParams: how one request samples and when it stops, validated at construction.

Every bad value raises a ValueError naming the field, the value and what is allowed,
so that bad input never reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

_GREEDY_EPS = 1e-5

# Bounds on what one request may ask for, so that its cost is bounded before it runs (offline
# and in the server alike). n / best_of: OpenAI's limit on n; logprobs: OpenAI's top_logprobs.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024  # the detokenizer holds back len - 1 chars while streaming
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; each costs work in every step's sampling metadata


class ParamError(ValueError):
    """A bad request field: `param` names it (the server's OpenAI error reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # picklable (it may cross to another process)
        return type(self), (self.param, str(self))


MAX_STRUCTURED_SPEC_CHARS = 1 << 20  # a schema / regex / grammar text; compiling costs with its size
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema (a dict or its text),
    any JSON object (`json_object`), a regex, a list of choices, or an EBNF (GBNF) grammar.
    The schema is kept as its text: the engine compiles each distinct text once."""

    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)
        if self.choice is not None:
            self.choice = list(self.choice)
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object is True else []
        if len(set_) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, regex, "
                f"choice, grammar, json_object; got {set_ or 'none'}",
            )
        kind = set_[0]
        if kind == "choice":
            if (
                not self.choice
                or len(self.choice) > MAX_CHOICES
                or any(not isinstance(c, str) or c == "" for c in self.choice)
            ):
                raise ParamError(
                    "structured_outputs.choice",
                    f"structured_outputs.choice must be a list of 1 to "
                    f"{MAX_CHOICES} non-empty strings, got {_show(self.choice)}",
                )
        elif kind != "json_object":
            v = getattr(self, kind)
            if not isinstance(v, str) or not v.strip():
                raise ParamError(
                    f"structured_outputs.{kind}",
                    f"structured_outputs.{kind} must be a non-empty string, got {_show(v)}",
                )
            if len(v) > MAX_STRUCTURED_SPEC_CHARS:
                raise ParamError(
                    f"structured_outputs.{kind}",
                    f"structured_outputs.{kind} must have at most {MAX_STRUCTURED_SPEC_CHARS} characters, got {len(v)}",
                )

    @property
    def kind(self) -> str:
        """json | json_object | regex | choice | grammar."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def spec(self) -> str:
        """The spec as text: with `kind`, the key of its compiled grammar."""
        k = self.kind
        if k == "json_object":
            return ""
        if k == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return getattr(self, k)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None  # sample best_of, return the n of highest cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: none; k >= 0: the sampled token's + the top k
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Internal (beam search): the core reports logprobs but appends no token; the caller
    # chooses the next token and appends it or forks the request.
    external_tokens: bool = False
    # vLLM's: free-form extras for plugins; "kv_transfer_params" drives P/D disaggregation.
    extra_args: Optional[dict] = None
    # Filled by the engine from the tokenizer / generation config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise ParamError("extra_args", f"extra_args must be a dict, got {self.extra_args!r}")
            from pagedllm.distributed.kv_transfer.config import validate_kv_transfer_params

            try:
                validate_kv_transfer_params(self.extra_args.get("kv_transfer_params"))
            except ValueError as e:
                raise ParamError("kv_transfer_params", str(e)) from None

    # ------------------------------------------------------------------ checks
    def _validate(self) -> None:
        def bad(name, value, allowed):
            raise ParamError(name, f"{name} must be {allowed}, got {_show(value)}")

        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            bad("n", self.n, f"an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not _is_int(self.best_of) or not (self.n <= self.best_of <= MAX_N)):
            bad("best_of", self.best_of, f"an integer in [n ({self.n}), {MAX_N}]")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "a number >= 0")
        if not _is_num(self.top_p) or not (0 < self.top_p <= 1):
            bad("top_p", self.top_p, "in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", self.top_k, "-1 (off) or an integer >= 1")
        if not _is_num(self.min_p) or not (0 <= self.min_p <= 1):
            bad("min_p", self.min_p, "in [0, 1]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "a number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not (-2 <= v <= 2):
                bad(name, v, "in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not (-(2**63) <= self.seed < 2**63)):
            bad("seed", self.seed, "a 64-bit integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", self.stop, f"at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            bad("stop", longest, f"strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", self.stop_token_ids, f"at most {MAX_STOP_TOKEN_IDS} token ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not (0 <= v <= MAX_LOGPROBS)):
                bad(name, v, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "a mapping of token id to a bias in [-100, 100]")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", self.logit_bias, f"at most {MAX_LOGIT_BIAS} entries")
            fixed = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    bad("logit_bias", self.logit_bias, "a mapping of token id to a bias in [-100, 100]")
                if tid < 0 or not _is_num(v) or not (-100 <= v <= 100):
                    bad("logit_bias", self.logit_bias, "a mapping of token id to a bias in [-100, 100]")
                fixed[tid] = float(v)
            self.logit_bias = fixed

    # ------------------------------------------------------------- properties
    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes or reports the logits: the token is their argmax."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.logit_bias
            and self.min_tokens == 0
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )

    @property
    def num_samples(self) -> int:
        """How many sibling sequences the request runs."""
        return self.best_of or self.n

    def child(self, index: int) -> "SamplingParams":
        """The params of sibling `index`: one sample, its own seed (seed + index)."""
        c = self.clone()
        c.n, c.best_of = 1, None
        if self.seed is not None:
            c.seed = self.seed + index
        if self.num_samples > self.n and c.logprobs is None:
            c.logprobs = 0  # best_of ranks siblings by cumulative logprob (best_of == n: nothing to rank)
        return c

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)


def pooling_params() -> SamplingParams:
    """What a pooling request carries through the engine: a pooling runner reads no sampling
    field; the request ends once its prompt is computed, with its pooled vector (worker/pooler.py)."""
    return SamplingParams(temperature=0.0, max_tokens=1)


def _show(value) -> str:
    """repr of a value for an error message, summarised when long (client input can be MiB)."""
    if isinstance(value, str) and len(value) > 80:
        return f"a string of {len(value)} characters"
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{len(value)} entries"
    return repr(value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
