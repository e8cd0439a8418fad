"""What a tool parser gives: the text meant for the user and the function calls, from the whole
output so far (`partial`: more may come; then only what cannot change is reported)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from partial_json_parser import Allow, MalformedJSON
from partial_json_parser import loads as partial_loads

# Partial JSON: unfinished objects and arrays are closed, unfinished scalars (a string, a
# number, `tr` of true) are left out, so every value reported is final.
_PARTIAL = Allow.ARR | Allow.OBJ


def loads(text: str, partial: bool) -> Any:
    """The JSON value of `text` (None if it is not JSON yet, or at all)."""
    text = text.strip()
    if not text:
        return None
    try:
        return partial_loads(text, _PARTIAL) if partial else json.loads(text)
    except (MalformedJSON, ValueError, TypeError, RecursionError):
        return None


@dataclass
class ParsedCall:
    name: Optional[str]  # None until the name is complete
    arguments: Any = None  # a dict (partial while streaming), None until it starts
    complete: bool = False  # the call's JSON is closed: its arguments are final


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def call_from(obj: Any, args_key: str, complete: bool) -> Optional[ParsedCall]:
    """{"name": ..., args_key: {...}} -> a ParsedCall; None when it is no such object."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    return ParsedCall(name if isinstance(name, str) else None, args, complete)


class ToolParser:
    """Parses one model family's tool calls out of its text (`--tool-call-parser NAME`).
    `tools`: the request's functions ({"name", "parameters"}), for formats whose values are
    typed by the schema. `keeps_special_tokens`: the calls' marker is a special token, so the
    request's text must keep special tokens (vLLM's adjust_request)."""

    keeps_special_tokens = False

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self.tools = tools or []

    def extract(self, text: str, partial: bool) -> ParsedOutput:
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
