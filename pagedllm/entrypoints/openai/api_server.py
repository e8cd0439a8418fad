"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM.

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...

Start-up: the engine core process is started and the server waits until its model is
loaded, then listens and logs one "ready" line with the URL. Every error is an OpenAI
error object {"error": {"message", "type", "param", "code"}}: bad input 400, a wrong API
key 401, an unknown model 404, overload (--max-waiting-requests) and a dead engine 503,
a request that made the engine fail a step 500 (400 when the engine found it invalid: the
other requests go on); never a stack trace. SIGINT / SIGTERM: stop accepting, abort what is
in flight, stop the core process, exit 0. When the core process dies, the requests in flight
get 503 and the server exits 1 (for a supervisor to restart it), unless
--restart-engine-on-failure: then a new core serves the next requests.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from http import HTTPStatus
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, bad_input_is_400, invalid_request, request_failed_error

logger = logging.getLogger("pagedllm.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                 503: "service_unavailable"}


def error_response(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
                   code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=OpenAIError(
        message, status, type or _STATUS_TYPES.get(status, "invalid_request_error"), param, code).body())


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
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


def _engine_error(e: Exception) -> JSONResponse:
    if isinstance(e, EngineOverloadedError):
        return error_response(503, str(e), "service_unavailable", None, "server_overloaded")
    return error_response(503, f"The engine is not available: {e}", "service_unavailable", None, "engine_dead")


async def _run_until_disconnect(coro, raw_request: Request):
    """Await `coro`, cancelling it (which aborts its requests) if the client disconnects."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            msg = await raw_request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    logger.debug("client disconnected: request cancelled")
    return None


class _AuthMiddleware:
    """Plain ASGI (streams and disconnects pass through untouched): 401 without the key."""

    def __init__(self, app, expected: bytes, protected: tuple[str, ...]) -> None:
        self.app, self.expected, self.protected = app, expected, protected

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and scope.get("path", "").startswith(self.protected)):
            got = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    got = v
            if not secrets.compare_digest(got, self.expected):
                resp = error_response(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                                      "invalid_request_error", None, "invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: Optional[str] = None,
              chat_template: Optional[str] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pagedllm", version=__version__, docs_url=None, redoc_url=None)
    created = int(time.time())
    completion = OpenAIServingCompletion(engine, served_model_names, chat_template)
    chat = OpenAIServingChat(engine, served_model_names, chat_template)
    app.state.engine = engine

    # ---------------------------------------------------------------- errors
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        msg = exc.detail if isinstance(exc.detail, str) else phrase
        if exc.status_code == 404:
            msg = f"{request.method} {request.url.path}: not found"
        return error_response(exc.status_code, msg)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return JSONResponse(status_code=exc.status, content=exc.body())

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "internal_error")

    # ---------------------------------------------------------------- body size, auth (outermost)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(_AuthMiddleware, expected=f"Bearer {api_key}".encode(),
                           protected=("/v1", "/tokenize", "/detokenize"))

    # ---------------------------------------------------------------- routes
    async def _handle(coro_fn, req, raw_request: Request):
        try:
            if req.stream:  # errors before the first chunk are plain HTTP errors
                return StreamingResponse(await coro_fn(req, raw_request), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            result = await _run_until_disconnect(coro_fn(req, raw_request), raw_request)
        except (EngineDeadError, EngineOverloadedError) as e:
            return _engine_error(e)
        except RequestFailedError as e:   # rendered by the OpenAIError handler above
            raise request_failed_error(e) from None
        except ValueError as e:   # the engine's validation: a 400 naming the field where it can
            raise invalid_request(e) from None
        if result is None:  # the client is gone
            return Response(status_code=499)
        return JSONResponse(result.model_dump(exclude_none=False))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return await _handle(completion.create_completion, req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return await _handle(chat.create_chat_completion, req, raw_request)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
             "root": engine.config.model_config.model, "parent": None,
             "max_model_len": engine.max_model_len} for name in served_model_names]}

    @app.get("/health")
    async def health():
        try:
            engine.check_health()
        except EngineDeadError as e:
            return _engine_error(e)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            with bad_input_is_400():
                engine.processor.check_prompt_chars(len(req.prompt))
            ids = engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            ids = chat.prompt_ids(chat.conversation(req.messages), req.add_generation_prompt, False)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        completion.check_model(req.model)
        vocab = engine.config.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens must be integers in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return app


# -------------------------------------------------------------------- running it
class _Server(uvicorn.Server):
    """uvicorn, plus: on the first signal, abort every request in flight (so streams end now)."""

    on_exit = None

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.on_exit is not None:
            self.on_exit()


def _load_chat_template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" in value:
        return value  # an inline Jinja template
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


async def serve(ns: argparse.Namespace, engine_args) -> int:
    from pagedllm.models.download import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    stop_during_start = []

    def on_signal_at_start(sig):
        stop_during_start.append(sig)
        main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal_at_start, sig)

    chat_template = _load_chat_template(ns.chat_template)
    # Listen first: a port in use fails at once, before the model is loaded.
    sock = _bind(ns.host, ns.port)
    port = sock.getsockname()[1]
    model = engine_args.model
    names = ns.served_model_name or [DEFAULT_MODEL if model is None or model in DEFAULT_MODEL_ALIASES else model]
    engine = None
    try:
        engine = AsyncLLM(engine_args, model_name=names[0], max_waiting_requests=ns.max_waiting_requests,
                          log_level=ns.serve_log_level.upper(), log_stats_interval=ns.log_stats_interval,
                          restart_engine_on_failure=ns.restart_engine_on_failure)
        logger.info("starting the engine core process (model %s)", engine.config.model_config.model)
        await engine.start()
        if chat_template is None and engine.tokenizer.chat_template is None:
            logger.warning("the model has no chat template: /v1/chat/completions needs --chat-template")
        app = build_app(engine, names, ns.api_key, chat_template, ns.max_request_body_bytes)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.serve_log_level.lower(),
                                access_log=ns.serve_log_level.lower() == "debug", lifespan="off",
                                timeout_graceful_shutdown=10, timeout_keep_alive=5)
        server = _Server(config)

        def on_exit():
            logger.info("shutting down: refusing new requests, aborting %d in flight", len(engine.queues))
            loop.call_soon_threadsafe(engine.stop_accepting)

        server.on_exit = on_exit
        exit_code = 0

        def on_engine_dead():
            nonlocal exit_code
            logger.error("the engine core is gone: exiting with code 1 for a supervisor to restart the "
                         "server (--restart-engine-on-failure restarts the core instead)")
            exit_code = 1
            server.should_exit = True

        engine.on_engine_dead = on_engine_dead
        if engine.errored is not None and not engine.restart_engine_on_failure:
            on_engine_dead()   # it died while the app was being built
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            # uvicorn re-raises the signal after its graceful shutdown; let that be a no-op
            # so that our own clean-up (stopping the core) runs and we exit 0.
            signal.signal(sig, lambda *_: None)
        serve_task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host = f"[{ns.host}]" if ":" in ns.host else ns.host
            logger.info("pagedllm %s ready: http://%s:%d (model %s, max_model_len %d, %d KV blocks)",
                        __version__, host, port, names[0], engine.max_model_len, engine.num_blocks)
        await serve_task
        return exit_code
    except asyncio.CancelledError:
        if stop_during_start:
            logger.info("stopped during start-up")
            return 0
        raise
    finally:
        sock.close()
        if engine is not None:
            await engine.shutdown()
            logger.info("engine core stopped")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def run_server(ns: argparse.Namespace, engine_args) -> int:
    level = ns.serve_log_level.upper()
    logging.basicConfig(level=min(logging.WARNING, logging.getLevelName(level)),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger().setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.getLogger("pagedllm").setLevel(level)
    try:
        return asyncio.run(serve(ns, engine_args))
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind
        return int(e.code or 0) if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:  # the engine core could not start (its log says why)
        logger.error("%s", e)
        return 1

