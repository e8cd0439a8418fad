"""Mistral format: text, then `[TOOL_CALLS]` and the calls, in one of the shapes Mistral's
tokenizers have used: a JSON array `[{"name": ..., "arguments": {...}}, ...]` (v3, Mistral 7B
v0.3 / Mixtral), or one `[TOOL_CALLS]name{...}` per call (v11, Mistral Small 3.1), or
`[TOOL_CALLS]name[ARGS]{...}` (v13, Devstral / Magistral). `[TOOL_CALLS]` is a special token: the
server keeps special tokens in the text of a request this parser reads (as vLLM does)."""

from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from,
    held_back,
    loads,
)

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def extract(self, text: str, partial: bool) -> ParsedOutput:
        head, sep, rest = text.partition(TAG)
        if not sep:  # a tail that may begin the tag waits while streaming
            return ParsedOutput(head[: len(head) - held_back(head, TAG)].rstrip() if partial else text)
        out = ParsedOutput(content=head.rstrip())
        if rest.lstrip().startswith("["):  # v3: one JSON array of calls
            calls = loads(rest, partial)
            if not isinstance(calls, list):
                return out if partial else ParsedOutput(text)
            for i, obj in enumerate(calls):
                # Partial: only the elements before the last are certainly closed.
                call = call_from(obj, "arguments", complete=not partial or i < len(calls) - 1)
                if call is None:
                    return ParsedOutput(text) if not partial else out
                out.calls.append(call)
            return out
        blocks = rest.split(TAG)
        for i, block in enumerate(blocks):
            call = _named_call(block, complete=not partial or i < len(blocks) - 1)
            if call is None:
                if partial:
                    break
                return ParsedOutput(text)  # not calls after all: the text stays text
            out.calls.append(call)
        return out


def _named_call(block: str, complete: bool) -> Optional[ParsedCall]:
    """`name{...}` or `name[ARGS]{...}` -> a ParsedCall (name None while it may still grow)."""
    name, sep, args = block.partition(ARGS)
    if not sep:
        brace = block.find("{")
        if brace < 0:  # the name, or its brace, is still to come
            return None if complete else ParsedCall(None)
        name, args = block[:brace], block[brace:]
    name = name.strip()
    if not name.replace("-", "_").replace(".", "_").isidentifier():
        return None
    arguments = loads(args, partial=not complete)
    if arguments is None and complete:
        return None
    if arguments is not None and not isinstance(arguments, dict):
        return None
    return ParsedCall(name, arguments, complete)
