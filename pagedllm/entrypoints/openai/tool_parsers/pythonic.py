"""Pythonic format (Llama 3.2 / Llama 4, ToolACE): the whole answer is a Python list of calls with
keyword arguments, `[get_weather(city='Paris', days=3), noop()]`, optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`. Values are Python literals (str, numbers, True / False /
None, lists, dicts), reported as JSON. A whole output is checked by Python's own parser; while
streaming, a scanner splits the calls and arguments at top-level commas (outside strings and
brackets) and reports the arguments already followed by a comma or the closing parenthesis."""

from __future__ import annotations

import ast
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].lstrip()
        if body.endswith(END):
            body = body[: -len(END)].rstrip()
        if not body.startswith("["):  # not (yet) calls: text, unless it may still become the tag
            return ParsedOutput("" if partial and START.startswith(body) else text)
        calls = _streamed_calls(body) if partial else _whole_calls(body)
        return ParsedOutput(text) if calls is None else ParsedOutput(calls=calls)


def _whole_calls(body: str) -> Optional[list[ParsedCall]]:
    """The calls of a finished list, by Python's parser; None when it is no list of calls."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            name = ast.unparse(node.func)
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(ParsedCall(name, args, complete=True))
    return calls


def _streamed_calls(body: str) -> Optional[list[ParsedCall]]:
    """The calls of a list still being written, as far as they are certain."""
    pieces, _ = _split(body[1:], "]")
    calls = []
    for i, piece in enumerate(pieces):
        name, paren, rest = piece.partition("(")
        if not paren:
            if piece.strip():  # the last call's name, still growing
                calls.append(ParsedCall(None))
            break
        args, end = _split(rest, ")")
        if end < 0:  # unclosed: its last argument may still grow
            args = args[:-1]
        arguments: dict[str, Any] = {}
        for arg in args:
            key, eq, value = arg.partition("=")
            if not arg.strip():
                continue
            if not eq:  # a positional argument: no call (the whole list will not parse either)
                return None
            try:
                arguments[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                return None
        calls.append(ParsedCall(name.strip(), arguments, complete=end >= 0))
    return calls


def _split(text: str, closer: str) -> tuple[list[str], int]:
    """`text` cut at its top-level commas up to the `closer` that ends it -> (pieces, the closer's
    index, or -1 when it has not come yet)."""
    pieces, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                pieces.append(text[start:i])
                return pieces, i if c == closer else -1
            depth -= 1
        elif c == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
        i += 1
    pieces.append(text[start:])
    return pieces, -1
