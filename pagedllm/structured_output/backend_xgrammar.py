"""xgrammar as the grammar engine: validation of a spec (frontend, no tokenizer), compilation
against the model's vocabulary (engine core, on the manager's threads), and the per-request
matcher that fills a token bitmask and advances with each accepted token."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from pagedllm.sampling_params import ParamError, StructuredOutputsParams

# xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: ": the message is after it.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def compiler_message(e: Exception) -> str:
    return _LOCATION.sub("", str(e)).strip()


# `json_object` (OpenAI's response_format): any JSON object, written compactly as the schemas are
# (any_whitespace=False): xgrammar's builtin JSON grammar admits whitespace runs between tokens,
# and a small model can spend its whole budget on them.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_grammar(kind: str, spec: str) -> xgr.Grammar:
    """The spec as an xgrammar Grammar (parsing only); raises the compiler's error."""
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)))
    return xgr.Grammar.from_ebnf(spec)


def validate_structured_outputs(params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """ParamError naming `param` (and the kind) with the compiler's message when the spec is invalid."""
    kind = params.kind
    try:
        to_grammar(kind, params.spec)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
        name = param if param != "structured_outputs" else f"structured_outputs.{kind}"
        raise ParamError(name, f"invalid {kind} for {name}: {compiler_message(e)}") from None


class XgrammarGrammar:
    """One request's matcher. `accept_tokens` advances it; `rollback` undoes the last tokens
    (for speculative decoding, whose rejected tokens were accepted first)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if not self.matcher.accept_token(t):
                return False
            self.num_processed_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class CompiledGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_grammar(self) -> XgrammarGrammar:
        return XgrammarGrammar(self.compiled)


class XgrammarBackend:
    """The compiler for one tokenizer; `vocab_size` is the model's (the logits' width, which may
    exceed the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)  # the manager runs several at once

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        c = self.compiler
        if kind == "json":
            return CompiledGrammar(c.compile_json_schema(spec, any_whitespace=False))
        if kind == "json_object":
            return CompiledGrammar(c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False))
        if kind == "regex":
            return CompiledGrammar(c.compile_regex(spec))
        return CompiledGrammar(c.compile_grammar(to_grammar(kind, spec)))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # [rows, ceil(V / 32)] int32
