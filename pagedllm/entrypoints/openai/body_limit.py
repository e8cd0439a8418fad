"""A request body larger than --max-request-body-bytes is refused with 413 before it is read whole.

Plain ASGI, outside FastAPI: a declared Content-Length over the limit is refused before a byte
of the body is read; a chunked body (no Content-Length) is counted as it arrives and refused as
soon as it passes the limit, so the server never holds more than the limit (plus one network
read) of one request's body. A body within the limit is handed to the app in one message, and
later messages (the client's disconnect) pass through.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.serving_engine import OpenAIError


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        # The HTTP parser has checked that a Content-Length is digits.
        if declared is not None and int(declared) > self.max_bytes:
            await self._refuse(int(declared), scope, receive, send)
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body ended: the app sees that
                first = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(None, scope, receive, send)
                return
            parts.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, declared, scope, receive, send) -> None:
        size = f" ({declared} bytes)" if declared is not None else ""
        err = OpenAIError(
            f"the request body{size} is larger than the server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)",
            status=413,
            code="request_too_large",
        )
        # The rest of the body is never read: the connection cannot carry another request.
        resp = JSONResponse(status_code=413, content=err.body(), headers={"Connection": "close"})
        await resp(scope, receive, send)
