"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM (AsyncEncoderEngine
for an encoder model: engine/async_encoder.py).

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

import asyncio
import logging
import os
import signal
import socket
import time
from typing import Optional, Sequence

import uvicorn
from fastapi import FastAPI

from pagedllm import __version__, envs
from pagedllm.engine.async_encoder import make_async_engine
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.auth import AuthMiddleware
from pagedllm.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES, FrontendArgs
from pagedllm.entrypoints.openai.errors import add_exception_handlers
from pagedllm.entrypoints.openai.routes import (
    PROTECTED_PATHS,
    dev_router,
    openai_router,
    server_router,
    tokenize_router,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_classify import OpenAIServingClassify
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_modules
from pagedllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.gc_heap import freeze_gc_heap

logger = logging.getLogger("pagedllm.server")


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: Optional[str] = None,
    chat_template: Optional[str] = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    lora_modules: Sequence[tuple[str, str]] = (),
    allow_runtime_lora_updating: bool = False,
    **chat_options,
) -> FastAPI:
    """The FastAPI app: routes (routes.py) reading what they serve from `app.state`, error
    handlers (errors.py), and the body-size limit and API key as the outermost middleware."""
    app = FastAPI(title="pagedllm", version=__version__, docs_url=None, redoc_url=None)
    state = app.state
    state.engine = engine
    state.served_model_names = served_model_names
    state.created = int(time.time())
    state.openai_serving_completion = OpenAIServingCompletion(engine, served_model_names, chat_template)
    # chat_options: enable_auto_tool_choice, tool_call_parser, reasoning_parser (OpenAIServingChat)
    state.openai_serving_chat = OpenAIServingChat(engine, served_model_names, chat_template, **chat_options)
    state.anthropic_serving_messages = AnthropicServingMessages(state.openai_serving_chat)
    state.openai_serving_responses = OpenAIServingResponses(state.openai_serving_chat)
    state.openai_serving_embedding = OpenAIServingEmbedding(engine, served_model_names)
    state.openai_serving_score = OpenAIServingScore(engine, served_model_names)
    state.openai_serving_classify = OpenAIServingClassify(engine, served_model_names)
    # The base model's names and the LoRA adapters' (serving_models.py), shared by every endpoint.
    state.models = OpenAIServingModels(engine, served_model_names, lora_modules, allow_runtime_lora_updating)
    for serving in (
        state.openai_serving_completion,
        state.openai_serving_chat,
        state.openai_serving_embedding,
        state.openai_serving_score,
        state.openai_serving_classify,
    ):
        serving.models = state.models
    for router in (openai_router, tokenize_router, server_router):
        app.include_router(router)
    if envs.PAGEDLLM_SERVER_DEV_MODE:
        app.include_router(dev_router)
    add_exception_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:  # added last: outermost, a request without the key is refused before anything
        app.add_middleware(AuthMiddleware, expected=f"Bearer {api_key}".encode(), protected=PROTECTED_PATHS)
    return app


# -------------------------------------------------------------------- running it
class _Server(uvicorn.Server):
    """uvicorn, plus: on the first signal, abort every request in flight (so streams end now);
    when the engine core dies (and is not restarted), stop with exit code 1."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config)
        self.engine, self.loop, self.exit_code = engine, loop, 0

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            logger.info("shutting down: refusing new requests, aborting %d in flight", len(self.engine.queues))
            self.loop.call_soon_threadsafe(self.engine.stop_accepting)

    def on_engine_dead(self) -> None:
        logger.error(
            "the engine core is gone: exiting with code 1 for a supervisor to restart the "
            "server (--restart-engine-on-failure restarts the core instead)"
        )
        self.exit_code = 1
        self.should_exit = True


def _load_chat_template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" in value:
        return value  # an inline Jinja template
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _cancel_on_signal(loop: asyncio.AbstractEventLoop) -> list:
    """Until uvicorn runs, SIGINT / SIGTERM cancel the start-up -> the signals seen (filled later)."""
    main_task = asyncio.current_task()
    seen = []

    def on_signal(sig):
        seen.append(sig)
        main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return seen


def _hand_signals_to_uvicorn(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
        # uvicorn re-raises the signal after its graceful shutdown; let that be a no-op
        # so that our own clean-up (stopping the core) runs and we exit 0.
        signal.signal(sig, lambda *_: None)


def _make_server(app: FastAPI, ns: FrontendArgs, engine: AsyncLLM) -> _Server:
    level = ns.serve_log_level.lower()
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=level,
        access_log=level == "debug",
        lifespan="off",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=5,
    )
    server = _Server(config, engine, asyncio.get_running_loop())
    engine.on_engine_dead = server.on_engine_dead
    if engine.errored is not None and not engine.restart_engine_on_failure:
        server.on_engine_dead()  # it died while the app was being built
    return server


async def _run(server: _Server, sock: socket.socket, ns: FrontendArgs, name: str, engine: AsyncLLM) -> None:
    """Serve on `sock` until uvicorn stops; log the "ready" line once it listens."""
    serve_task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host = f"[{ns.host}]" if ":" in ns.host else ns.host
        logger.info(
            "pagedllm %s ready: http://%s:%d (model %s, max_model_len %d, %d KV blocks)",
            __version__,
            host,
            sock.getsockname()[1],
            name,
            engine.max_model_len,
            engine.num_blocks,
        )
    await serve_task


async def serve(ns: FrontendArgs, engine_args) -> int:
    from pagedllm.models.download import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES

    loop = asyncio.get_running_loop()
    stop_during_start = _cancel_on_signal(loop)
    chat_template = _load_chat_template(ns.chat_template)
    # Listen first: a port in use fails at once, before the model is loaded.
    sock = _bind(ns.host, ns.port)
    model = engine_args.model
    names = ns.served_model_name or [DEFAULT_MODEL if model is None or model in DEFAULT_MODEL_ALIASES else model]
    engine = None
    try:
        engine = make_async_engine(
            engine_args,
            names[0],
            max_waiting_requests=ns.max_waiting_requests,
            log_level=ns.serve_log_level.upper(),
            log_stats_interval=ns.log_stats_interval,
            restart_engine_on_failure=ns.restart_engine_on_failure,
            metrics_prefix=ns.metrics_prefix,
        )
        logger.info("starting the engine (model %s)", engine.config.model_config.model)
        await engine.start()
        if (
            engine.config.model_config.runner == "generate"
            and chat_template is None
            and engine.tokenizer.chat_template is None
        ):
            logger.warning("the model has no chat template: /v1/chat/completions needs --chat-template")
        app = build_app(
            engine,
            names,
            ns.api_key,
            chat_template,
            ns.max_request_body_bytes,
            lora_modules=parse_lora_modules(ns.lora_modules),
            allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            tool_call_parser=ns.tool_call_parser,
            reasoning_parser=ns.reasoning_parser,
        )
        server = _make_server(app, ns, engine)
        freeze_gc_heap("API server")
        _hand_signals_to_uvicorn(loop)
        await _run(server, sock, ns, names[0], engine)
        return server.exit_code
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


def _event_loop_runner():
    """uvloop where it is installed (as vLLM serves): a streaming server spends much of its time
    writing events to sockets, and uvloop's transports cost less CPU there than asyncio's (with
    httptools: 4.3-4.9 ms a 32-token stream against 6.2 on asyncio + h11, BENCHMARKS.md)."""
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run
    return uvloop.run


def run_server(ns: FrontendArgs, engine_args) -> int:
    level = ns.serve_log_level.upper()
    logging.basicConfig(
        level=min(logging.WARNING, logging.getLevelName(level)),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger().setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.getLogger("pagedllm").setLevel(level)
    try:
        return _event_loop_runner()(serve(ns, engine_args))
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind
        return int(e.code or 0) if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:  # the engine core could not start (its log says why)
        logger.error("%s", e)
        return 1
