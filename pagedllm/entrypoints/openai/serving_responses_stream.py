"""The Responses API's streaming events from the chat path's chunks: response.created and
response.in_progress; per output item (reasoning, message, each function_call)
response.output_item.added, its deltas (response.reasoning_text.delta, response.output_text.delta
inside a content part, response.function_call_arguments.delta) and their .done, then
response.output_item.done; then response.completed (response.incomplete for an answer the length
cap ended) with every item. Each event has its sequence_number; `event:` + `data:` SSE lines, no
[DONE]. An error after the stream began is an `error` event."""

from __future__ import annotations

import itertools
from typing import AsyncIterator, Callable, Optional

from pagedllm.entrypoints.openai.protocol_responses import (
    ResponseHead,
    function_call_item,
    hex_id,
    status_of,
    text_item,
    usage_of,
)
from pagedllm.entrypoints.openai.serving_engine import sse, sse_chunks

_DELTA_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}
_ID_PREFIXES = {"reasoning": "rs", "message": "msg"}


class _Items:
    """The output items of one stream: the open one (a new kind, or a new call, closes it) and
    those done. A message's events carry (empty) logprobs, as OpenAI's do."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.done: list[dict] = []
        self.key: Optional[tuple] = None
        self.item: dict = {}  # the open item as added (in progress)
        self.text = ""  # its text, or its call's arguments, so far

    def event(self, type_: str, **fields) -> str:
        return f"event: {type_}\n" + sse({"type": type_, "sequence_number": next(self.seq), **fields})

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.done)}

    def _extra(self) -> dict:
        return {"logprobs": []} if self.item["type"] == "message" else {}

    def _open(self, key: tuple, item: dict) -> list[str]:
        if key == self.key:
            return []
        out = self.close("completed")
        self.key, self.item, self.text = key, item, ""
        out.append(self.event("response.output_item.added", output_index=len(self.done), item=item))
        if item["type"] != "function_call":
            part = text_item(item["type"], item["id"], "", "completed")["content"][0]
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        out = self._open((kind,), text_item(kind, hex_id(_ID_PREFIXES[kind]), "", "in_progress"))
        self.text += delta
        return out + [
            self.event(_DELTA_EVENTS[kind] + ".delta", **self._where(), content_index=0, delta=delta, **self._extra())
        ]

    def delta(self, delta: dict) -> list[str]:
        """The events of one chat delta (reasoning_content, content, tool_calls)."""
        out = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a call's first delta: its id and name
                out += self._open(
                    ("function_call", call.get("index")),
                    function_call_item(hex_id("fc"), call["id"], fn.get("name"), "", "in_progress"),
                )
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return out

    def close(self, status: str) -> list[str]:
        if self.key is None:
            return []
        item, text, where = self.item, self.text, self._where()
        if item["type"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, arguments=text)]
            final = function_call_item(item["id"], item["call_id"], item["name"], text, status)
        else:
            final = text_item(item["type"], item["id"], text, status)
            out = [
                self.event(_DELTA_EVENTS[item["type"]] + ".done", **where, content_index=0, text=text, **self._extra()),
                self.event("response.content_part.done", **where, content_index=0, part=final["content"][0]),
            ]
        out.append(self.event("response.output_item.done", output_index=len(self.done), item=final))
        self.done.append(final)
        self.key = None
        return out

    def finish(self, status: str) -> list[str]:
        """Close the last item with the response's status; an answer with neither text nor calls
        still has its (empty) message, as the whole answer has."""
        out, kinds = [], {it["type"] for it in self.done} | ({self.item["type"]} if self.key else set())
        if not kinds & {"message", "function_call"}:
            out = self._open(("message",), text_item("message", hex_id("msg"), "", "in_progress"))
        return out + self.close(status)


async def responses_events(
    chat_stream: AsyncIterator[str], head: ResponseHead, finished: Callable[[dict, list[dict]], dict]
) -> AsyncIterator[str]:
    """`finished(body, items)`: the final response's body (kept where it is stored)."""
    items = _Items()
    yield items.event("response.created", response=head.body("in_progress", []))
    yield items.event("response.in_progress", response=head.body("in_progress", []))
    finish, usage = None, {}
    async for chunk in sse_chunks(chat_stream):
        if chunk is None:
            break
        if "error" in chunk:
            err = chunk["error"]
            yield items.event(
                "error", code=err.get("code") or err.get("type"), message=err.get("message"), param=err.get("param")
            )
            return
        usage = chunk.get("usage") or usage  # the last chunk's: the prompt, the answer, the cached part
        for c in chunk.get("choices", []):
            for e in items.delta(c.get("delta") or {}):
                yield e
            finish = c.get("finish_reason") or finish
    status = status_of(finish)
    for e in items.finish(status):
        yield e
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    body = head.body(
        status, items.done, usage_of(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), cached)
    )
    yield items.event(
        "response.incomplete" if status == "incomplete" else "response.completed", response=finished(body, items.done)
    )
