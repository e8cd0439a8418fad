"""--api-key: a request to a protected path without `Authorization: Bearer <key>` gets 401.

Plain ASGI, outside FastAPI, so that streams and disconnects pass through untouched; the key is
compared in constant time."""

from __future__ import annotations

import secrets

from pagedllm.entrypoints.openai.errors import error_response


class AuthMiddleware:
    def __init__(self, app, expected: bytes, protected: tuple[str, ...]) -> None:
        self.app, self.expected, self.protected = app, expected, protected

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and scope.get("path", "").startswith(self.protected)
        ):
            got = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    got = v
            if not secrets.compare_digest(got, self.expected):
                resp = error_response(
                    401,
                    "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
