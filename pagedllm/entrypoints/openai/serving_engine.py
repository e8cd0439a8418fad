"""What the completion and chat handlers share: errors in OpenAI's shape, the model-name and
context-length checks, logprob conversion, merging several request streams into one, and
beam search (use_beam_search: n is the width; the search runs in the engine core)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import AsyncIterator, Optional, Sequence

from pagedllm.engine.async_llm import AsyncLLM, BeamSearchHandle, RequestStream
from pagedllm.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchOutput
from pagedllm.engine.processor import check_prompt_len
from pagedllm.entrypoints.openai.protocol import MAX_PROMPTS
from pagedllm.outputs import Logprob, RequestOutput

logger = logging.getLogger("pagedllm.server")


class OpenAIError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(e: ValueError, renames: Optional[dict[str, str]] = None) -> OpenAIError:
    """A 400 for the engine's validation error; the field it names (a ParamError's `param`) is
    renamed where the API calls it otherwise (chat's top_logprobs is the engine's logprobs)."""
    message, param = str(e), getattr(e, "param", None)
    if renames and param in renames:
        if message.startswith(param):
            message = renames[param] + message[len(param) :]
        param = renames[param]
    return OpenAIError(message, param=param)


def renamed_error(e: OpenAIError, renames: dict[str, str]) -> OpenAIError:
    """An error of the chat path in the words of an API built on it (Anthropic's, the Responses
    API's): the field it names renamed, in `param` and in the message. A key may be a path
    (`messages[1].content[0]`): it is renamed where it stands whole, not inside a longer path."""
    new = renames.get(e.param) if e.param else None
    if new is None:
        return e
    whole = rf"(?<![\w.\]]){re.escape(e.param)}(?![\w\[]|\.\w)"
    return OpenAIError(re.sub(whole, new, e.message), e.status, e.type, new, e.code)


@contextlib.contextmanager
def bad_input_is_400(renames: Optional[dict[str, str]] = None):
    """The engine's validation errors (ValueError) inside become 400 OpenAI errors."""
    try:
        yield
    except ValueError as e:
        raise invalid_request(e, renames) from None


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_chunks(lines: AsyncIterator[str]) -> AsyncIterator[Optional[dict]]:
    """A chat stream's SSE lines as dicts (None for [DONE]), for the APIs that re-shape it."""
    async for line in lines:
        data = line[len("data: ") :].strip()
        yield None if data == "[DONE]" else json.loads(data)


async def stream_final(make_response, head: dict, chunk_choice, include_usage: bool) -> AsyncIterator[str]:
    """A response with no partial output (beam search) as a stream: awaits make_response(),
    then each final choice in one chunk (chunk_choice(choice) -> its dict), the usage chunk when
    asked, then [DONE]; an error after the stream began goes into the stream."""
    try:
        full = await make_response()
        for c in full.choices:
            chunk = {**head, "choices": [chunk_choice(c)]}
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": full.usage.model_dump()})
    except Exception as e:  # the engine died or the server is stopping
        yield sse(stream_error(e).body())
    yield SSE_DONE


class JSONBody(dict):
    """A response body built as a plain dict (no pydantic model): routes.py returns it as it is."""

    def model_dump(self, **_) -> dict:
        return dict(self)


def request_failed_error(e) -> OpenAIError:
    """A request that made the engine fail a step (RequestFailedError): 500, or 400 when the
    engine found the request invalid; the other requests went on."""
    if e.client_error:
        return OpenAIError(str(e), status=400, code="request_failed")
    return OpenAIError(str(e), status=500, type="internal_error", code="request_failed")


def stream_error(e: BaseException) -> OpenAIError:
    """An error met after a stream started: it goes into the stream as an error event."""
    from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError, RequestFailedError

    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RequestFailedError):
        return request_failed_error(e)
    if isinstance(e, (EngineDeadError, EngineOverloadedError)):
        return OpenAIError(str(e), status=503, type="service_unavailable", code="engine_unavailable")
    logger.error("error in a stream: %s: %s", type(e).__name__, e, exc_info=e)
    return OpenAIError("internal server error", status=500, type="internal_error")


def _token_bytes_decoder():
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLM, served_model_names: Sequence[str], chat_template: Optional[str] = None
    ) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # --generation-config: the model's sampling defaults for the fields a request leaves unset.
        self.sampling_defaults = engine.config.model_config.sampling_defaults
        self._byte_decoder = None
        self._bytes_cache: dict[int, list[int]] = {}
        self.models = None  # serving_models.OpenAIServingModels, set by build_app: adapters' names too

    # ------------------------------------------------------------ checks
    def lora_request(self, model: Optional[str]):
        """The LoRARequest of the adapter `model` names; None for the base model."""
        return self.models.lora_request(model) if self.models is not None else None

    def check_model(self, model: Optional[str]) -> None:
        if self.models is not None:
            return self.models.check_model(model)
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist.",
                status=404,
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def check_context(
        self, num_prompt: int, max_tokens: Optional[int], what: str, max_tokens_param: str = "max_tokens"
    ) -> int:
        """The number of tokens to generate; OpenAIError 400 when the prompt and the completion
        do not fit in the context (OpenAI's wording, with the numbers)."""
        n = self.max_model_len
        if max_tokens is None:
            try:
                check_prompt_len(num_prompt, n)
            except ValueError:
                raise OpenAIError(
                    f"This model's maximum context length is {n} tokens. However, your {what} resulted in "
                    f"{num_prompt} tokens. Please reduce the length of the {what}.",
                    param=what,
                    code="context_length_exceeded",
                ) from None
            return n - num_prompt
        if num_prompt + max_tokens > n:
            raise OpenAIError(
                f"This model's maximum context length is {n} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                param=what,
                code="context_length_exceeded",
            )
        return max_tokens

    @staticmethod
    def check_stream_fields(req) -> None:
        """400 for fields that need stream (stream_options, as OpenAI and vLLM) or that a
        stream cannot carry (prompt_logprobs, as vLLM), and for prompt_logprobs with beam search."""
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise OpenAIError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        if req.prompt_logprobs is not None and req.use_beam_search:
            raise OpenAIError("prompt_logprobs is not supported with use_beam_search", param="prompt_logprobs")

    def tokenize_prompts(self, p, add_special_tokens: bool, param: str) -> list[tuple[Optional[str], list[int]]]:
        """A string, a list of strings, token ids or lists of them -> [(text or None, token ids)],
        validated by the engine's Processor; 400 naming `param`."""
        if isinstance(p, str):
            items = [p]
        elif len(p) == 0:
            raise OpenAIError(f"{param} must not be empty", param=param)
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if len(items) > MAX_PROMPTS:
            raise OpenAIError(f"{param} must be at most {MAX_PROMPTS} prompts, got {len(items)}", param=param)
        out = []
        for item in items:
            try:
                out.append(self.engine.processor.tokenize(item, add_special_tokens=add_special_tokens))
            except ValueError as e:
                raise OpenAIError(str(e), param=param) from None
        return out

    # ------------------------------------------------------------ beam search
    @staticmethod
    def check_beam_search(req) -> int:
        """The beam width (n); OpenAIError 400 naming a field beam search cannot honour."""
        n = req.n if req.n is not None else 1
        if not 1 <= n <= MAX_BEAM_WIDTH:
            raise OpenAIError(
                f"n (the beam width with use_beam_search) must be an integer in [1, {MAX_BEAM_WIDTH}], got {n}",
                param="n",
            )
        bad = req.beam_search_conflict()
        if bad in ("logprobs", "top_logprobs"):
            raise OpenAIError(
                f"{bad} must be 0 with use_beam_search (a search reports the logprobs of the "
                "tokens it chose, without alternatives)",
                param=bad,
            )
        if bad is not None:
            raise OpenAIError(
                f"{bad} is not supported with use_beam_search (beam search is deterministic "
                "and stops on EOS or the token limit only)",
                param=bad,
            )
        return n

    def start_beam_searches(self, req, prompts: list[tuple[list[int], int]], request_id: str) -> list[BeamSearchHandle]:
        """One search per (prompt ids, max_tokens), all validated and sent, or none."""
        if self.lora_request(req.model) is not None:
            raise OpenAIError("use_beam_search is not supported with a LoRA adapter", param="model")
        handles: list[BeamSearchHandle] = []
        try:
            for i, (ids, max_tokens) in enumerate(prompts):
                handles.append(
                    self.engine.add_beam_search(
                        {"prompt_token_ids": ids},
                        req.n or 1,
                        max_tokens,
                        req.length_penalty,
                        req.ignore_eos,
                        f"{request_id}-{i}",
                        priority=req.priority,
                    )
                )
        except BaseException as e:
            for h in handles:
                h.close()
            if isinstance(e, ValueError):
                raise invalid_request(e) from None
            raise
        return handles

    @staticmethod
    async def beam_results(handles: Sequence[BeamSearchHandle]) -> list[BeamSearchOutput]:
        """Every search's result; an error or a cancellation aborts the searches still running."""
        tasks = [asyncio.ensure_future(h.result()) for h in handles]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()  # a no-op for those done
            for h in handles:
                h.close()
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]  # all retrieved
        for e in errors:
            if e is not None:
                raise e
        return [t.result() for t in tasks]

    def beam_logprobs(self, h) -> list[dict[int, Logprob]]:
        """A hypothesis' chosen tokens with their logprobs, in the shape of a request's logprobs=0."""
        return [{t: Logprob(lp, None, self.tokenizer.decode([t]))} for t, lp in zip(h.tokens, h.logprobs)]

    # ------------------------------------------------------------ logprobs
    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes (byte-level BPE), else the UTF-8 of its text."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        out = None
        try:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            if isinstance(piece, str):
                if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                    out = [int(piece[3:5], 16)]
                else:
                    if self._byte_decoder is None:
                        self._byte_decoder = _token_bytes_decoder()
                    if piece and all(c in self._byte_decoder for c in piece):
                        out = [self._byte_decoder[c] for c in piece]
        except Exception:
            out = None
        if out is None:
            out = list(text.encode("utf-8"))
        self._bytes_cache[token_id] = out
        return out

    @staticmethod
    def sampled_and_top(pos: dict[int, Logprob], k: int):
        """(sampled id, its Logprob), and the top k (id, Logprob) by rank."""
        items = list(pos.items())
        sampled = items[0]
        top = sorted((it for it in items if it[1].rank is not None and it[1].rank <= k), key=lambda it: it[1].rank)[:k]
        return sampled, top

    def token_str(self, tid: int, lp: Logprob) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])

    # ------------------------------------------------------------ streams
    @staticmethod
    async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index of the stream, output) as they come from several streams; closing the
        merged iterator (or an error in one) closes them all, aborting what is unfinished."""
        if len(streams) == 1:
            try:
                async for out in streams[0]:
                    yield 0, out
            finally:
                streams[0].close()
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    q.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                q.put_nowait((i, e))
            finally:
                q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            done = 0
            while done < len(streams):
                i, item = await q.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()
