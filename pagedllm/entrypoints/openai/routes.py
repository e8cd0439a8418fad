"""The server's routes, one APIRouter per concern, as vLLM's api_server has them: the OpenAI API
(/v1/completions, /v1/chat/completions, /v1/responses, Anthropic's /v1/messages, /v1/embeddings, /v1/models), tokenisation (/tokenize, /detokenize) and
the server's own (/health, /version, /metrics; POST /reset_prefix_cache in development mode). A route finds the engine and the serving objects
on `app.state` (set by `build_app`)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pagedllm import __version__
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.entrypoints.openai.errors import engine_error
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.protocol_score import ClassifyRequest, PoolingRequest, RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.serving_classify import OpenAIServingClassify
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    bad_input_is_400,
    invalid_request,
    request_failed_error,
)

logger = logging.getLogger("pagedllm.server")

openai_router = APIRouter()
tokenize_router = APIRouter()
server_router = APIRouter()
dev_router = APIRouter()  # with PAGEDLLM_SERVER_DEV_MODE=1 only (vLLM's development routes)
# What --api-key guards: everything but the server's own routes (a probe needs no key).
PROTECTED_PATHS = (
    "/v1",
    "/v2",
    "/tokenize",
    "/detokenize",
    "/score",
    "/rerank",
    "/pooling",
    "/classify",
    "/reset_prefix_cache",
)
# Other paths of the same endpoint (an encoder model lists the canonical ones).
_ALIASES = {"/v1/score": "/score", "/rerank": "/v1/rerank", "/v2/rerank": "/v1/rerank", "/v1/classify": "/classify"}


def engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


def completion(request: Request) -> OpenAIServingCompletion:
    return request.app.state.openai_serving_completion


def chat(request: Request) -> OpenAIServingChat:
    return request.app.state.openai_serving_chat


def responses(request: Request) -> OpenAIServingResponses:
    return request.app.state.openai_serving_responses


def messages(request: Request) -> AnthropicServingMessages:
    return request.app.state.anthropic_serving_messages


def embedding(request: Request) -> OpenAIServingEmbedding:
    return request.app.state.openai_serving_embedding


def scoring(request: Request) -> OpenAIServingScore:
    return request.app.state.openai_serving_score


def classifying(request: Request) -> OpenAIServingClassify:
    return request.app.state.openai_serving_classify


# -------------------------------------------------------------------- the OpenAI API
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


def _check_runner(raw_request: Request, runner: str) -> None:
    """A generation endpoint on a --runner pooling server (or /v1/embeddings on a generating
    one) is a 400 saying which runner serves it; on an encoder model, an endpoint it does not
    serve is a 400 listing those it does."""
    mc = engine(raw_request).config.model_config
    path = raw_request.url.path
    endpoints = getattr(mc, "endpoints", None)  # an encoder model (engine/async_encoder.py)
    if endpoints is not None:
        if _ALIASES.get(path, path) not in endpoints:
            raise OpenAIError(
                f"{path} is not served for this model: {raw_request.app.state.served_model_names[0]} "
                f"({mc.architecture}) is {mc.kind} encoder model, which serves "
                f"{', '.join(endpoints)}",
                param="model",
                code="unsupported_endpoint",
            )
        return
    have = mc.runner
    if have != runner:
        raise OpenAIError(
            f"{raw_request.url.path} needs a server started with --runner {runner}; this one runs --runner {have}",
            param="model",
            code="wrong_runner",
        )


async def _respond(create, req, raw_request: Request, runner: str = "generate"):
    """`create(req, raw_request)` (a completion, chat, response or embedding) as a streamed or a
    JSON response."""
    _check_runner(raw_request, runner)
    try:
        if getattr(req, "stream", False):  # errors before the first chunk are plain HTTP errors
            return StreamingResponse(
                await create(req, raw_request), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        result = await _run_until_disconnect(create(req, raw_request), raw_request)
    except (EngineDeadError, EngineOverloadedError) as e:
        return engine_error(e)
    except RequestFailedError as e:  # rendered by the OpenAIError handler
        raise request_failed_error(e) from None
    except ValueError as e:  # the engine's validation: a 400 naming the field where it can
        raise invalid_request(e) from None
    if result is None:  # the client is gone
        return Response(status_code=499)
    return JSONResponse(result.model_dump(exclude_none=False))


@openai_router.post("/v1/completions")
async def create_completion(req: CompletionRequest, raw_request: Request):
    return await _respond(completion(raw_request).create_completion, req, raw_request)


@openai_router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
    return await _respond(chat(raw_request).create_chat_completion, req, raw_request)


@openai_router.post("/v1/responses")
async def create_response(req: ResponsesRequest, raw_request: Request):
    return await _respond(responses(raw_request).create_response, req, raw_request)


@openai_router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request):
    """A kept response (store, with the server's store on); 404 for an unknown, expired or deleted id."""
    return JSONResponse(responses(raw_request).stored(response_id)[0])


@openai_router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request):
    responses(raw_request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@openai_router.post("/v1/messages")
async def create_message(req: MessagesRequest, raw_request: Request):
    """Anthropic's Messages API (errors in Anthropic's shape: errors.py)."""
    return await _respond(messages(raw_request).create_message, req, raw_request)


@openai_router.post("/v1/messages/count_tokens")
async def count_message_tokens(req: CountTokensRequest, raw_request: Request):
    return await _respond(messages(raw_request).count_tokens, req, raw_request)


@openai_router.post("/v1/embeddings")
async def create_embedding(req: EmbeddingRequest, raw_request: Request):
    return await _respond(embedding(raw_request).create_embedding, req, raw_request, runner="pooling")


@openai_router.post("/score")
@openai_router.post("/v1/score")
async def create_score(req: ScoreRequest, raw_request: Request):
    return await _respond(scoring(raw_request).create_score, req, raw_request, runner="pooling")


@openai_router.post("/rerank")
@openai_router.post("/v1/rerank")
@openai_router.post("/v2/rerank")
async def create_rerank(req: RerankRequest, raw_request: Request):
    return await _respond(scoring(raw_request).create_rerank, req, raw_request, runner="pooling")


@openai_router.post("/pooling")
async def create_pooling(req: PoolingRequest, raw_request: Request):
    return await _respond(scoring(raw_request).create_pooling, req, raw_request, runner="pooling")


@openai_router.post("/classify")
@openai_router.post("/v1/classify")
async def create_classify(req: ClassifyRequest, raw_request: Request):
    return await _respond(classifying(raw_request).create_classify, req, raw_request, runner="pooling")


@openai_router.get("/v1/models")
async def list_models(raw_request: Request):
    """The base model's names, then each LoRA adapter with its `parent`."""
    state = raw_request.app.state
    return {"object": "list", "data": state.models.model_cards(state.created, state.engine.max_model_len)}


@openai_router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, raw_request: Request):
    """The openai client's models.retrieve; 404 model_not_found for a name not served."""
    state = raw_request.app.state
    state.models.check_model(model)
    return next(c for c in state.models.model_cards(state.created, state.engine.max_model_len) if c["id"] == model)


@openai_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw_request: Request):
    """vLLM's: serve a PEFT adapter directory under lora_name (--allow-runtime-lora-updating)."""
    return PlainTextResponse(raw_request.app.state.models.load_lora_adapter(req))


@openai_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw_request: Request):
    return PlainTextResponse(raw_request.app.state.models.unload_lora_adapter(req))


# -------------------------------------------------------------------- tokenisation
@tokenize_router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw_request: Request):
    eng = engine(raw_request)
    completion(raw_request).check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError("give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        with bad_input_is_400():
            eng.processor.check_prompt_chars(len(req.prompt))
        ids = eng.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    else:
        serving = chat(raw_request)
        ids = serving.prompt_ids(serving.conversation(req.messages), req.add_generation_prompt, False)
    return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": list(ids)}


@tokenize_router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw_request: Request):
    eng = engine(raw_request)
    completion(raw_request).check_model(req.model)
    vocab = eng.config.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(f"tokens must be integers in [0, {vocab}), got {bad[0]}", param="tokens")
    return {"prompt": eng.tokenizer.decode(req.tokens)}


# -------------------------------------------------------------------- the server's own
@server_router.get("/health")
async def health(raw_request: Request):
    try:
        engine(raw_request).check_health()
    except EngineDeadError as e:
        return engine_error(e)
    return Response(status_code=200)


@server_router.get("/version")
async def version():
    return {"version": __version__}


@server_router.get("/metrics")
async def metrics(raw_request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(engine(raw_request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request):
    """Forget every cached block (e.g. between timed benchmark runs): 200, or 409 while requests
    are running (their blocks stay cached: nothing is reset)."""
    eng = engine(raw_request)
    if not isinstance(eng, AsyncLLM):
        raise OpenAIError("/reset_prefix_cache: this model has no prefix cache (an encoder model)", status=400)
    try:
        done = await eng.reset_prefix_cache()
    except EngineDeadError as e:
        return engine_error(e)
    if not done:
        raise OpenAIError(
            "the prefix cache cannot be reset while requests are running; retry when the server is idle",
            status=409,
            type="conflict_error",
            code="requests_running",
        )
    return Response(status_code=200)
