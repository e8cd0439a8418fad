"""Every error the server sends is an OpenAI error object {"error": {"message", "type", "param",
"code"}} (Anthropic's {"type": "error", "error": {"type", "message"}} under /v1/messages), never
a stack trace: FastAPI's own errors (validation 400, unknown route 404, ...) are
rewritten into one here, an OpenAIError raised by a route is rendered as it says, anything else
is a logged 500."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.exceptions import EngineOverloadedError
from pagedllm.entrypoints.openai.serving_engine import OpenAIError

logger = logging.getLogger("pagedllm.server")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable",
}


# Anthropic's error types by HTTP status (/v1/messages)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(message: str, status_or_type=400) -> dict:
    kind = status_or_type if isinstance(status_or_type, str) else _ANTHROPIC_TYPES.get(status_or_type, "api_error")
    if kind not in _ANTHROPIC_TYPES.values():  # an OpenAI error type
        kind = {
            "service_unavailable": "overloaded_error",
            "internal_error": "api_error",
            "server_error": "api_error",
        }.get(kind, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _shaped(request: Request, response: JSONResponse) -> JSONResponse:
    """The OpenAI error `response` as Anthropic's for a /v1/messages route (same status)."""
    if not request.url.path.startswith(ANTHROPIC_PREFIX):
        return response
    err = json.loads(response.body)["error"]
    status = response.status_code
    return JSONResponse(status_code=status, content=anthropic_error_body(err["message"], status))


def error_response(
    status: int, message: str, type: Optional[str] = None, param: Optional[str] = None, code: Optional[str] = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content=OpenAIError(
            message, status, type or _STATUS_TYPES.get(status, "invalid_request_error"), param, code
        ).body(),
    )


def engine_error(e: Exception) -> JSONResponse:
    """503 for an engine that is overloaded (--max-waiting-requests) or dead."""
    if isinstance(e, EngineOverloadedError):
        return error_response(503, str(e), "service_unavailable", None, "server_overloaded")
    return error_response(503, f"The engine is not available: {e}", "service_unavailable", None, "engine_dead")


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """pydantic's first error as one line -> (message, the top-level field it names)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = e.get("msg", "invalid value")
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{where}: {msg}" if where else msg) + more, param


async def _validation(request: Request, exc: RequestValidationError):
    msg, param = validation_message(exc)
    return _shaped(request, error_response(400, msg, param=param))


async def _http(request: Request, exc: StarletteHTTPException):
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    msg = exc.detail if isinstance(exc.detail, str) else phrase
    if exc.status_code == 404:
        msg = f"{request.method} {request.url.path}: not found"
    return _shaped(request, error_response(exc.status_code, msg))


async def _openai(request: Request, exc: OpenAIError):
    return _shaped(request, JSONResponse(status_code=exc.status, content=exc.body()))


async def _internal(request: Request, exc: Exception):
    logger.exception("internal error on %s %s", request.method, request.url.path)
    return _shaped(request, error_response(500, "internal server error", "internal_error"))


def add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(OpenAIError, _openai)
    app.add_exception_handler(Exception, _internal)
