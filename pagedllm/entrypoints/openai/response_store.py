"""The Responses API's memory: responses made with `store: true`, each with the conversation
that led to it (so previous_response_id can carry it into the next turn), bounded in number
(the oldest are dropped) and in time (expired entries are dropped when met)."""

from __future__ import annotations

import time
from collections import OrderedDict

from pagedllm.entrypoints.openai.serving_engine import OpenAIError


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError(f"the response store needs max_entries >= 1 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._items: OrderedDict[str, tuple[float, dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        """Keep `body` (the response) and `conversation` (its messages, the answer last)."""
        self._items[body["id"]] = (time.monotonic() + self.ttl_s, body, conversation)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(body, conversation); 404 for an id never stored, expired, dropped or deleted."""
        item = self._items.get(response_id)
        if item is not None and item[0] < time.monotonic():
            del self._items[response_id]
            item = None
        if item is None:
            raise OpenAIError(
                f"no stored response with id {response_id!r} (unknown, expired or deleted; "
                "only responses made with store: true are kept)",
                status=404,
                param=param,
                code="response_not_found",
            )
        return item[1], item[2]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
