"""POST /v1/completions: a prompt (string, list of strings, token ids or lists of them) ->
choices (prompt i, sample j has index i * n + j), streamed or not. With use_beam_search, one
search of width n per prompt: its n best hypotheses are the choices, best first."""
from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptTokensDetails,
    UsageInfo, usage_dict, random_id)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, OpenAIServing, bad_input_is_400, sse,
                                                      stream_error, stream_final)


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        """[(text or None, token ids)], validated by the engine's Processor."""
        return self.tokenize_prompts(req.prompt, req.add_special_tokens, "prompt")

    async def create_completion(self, req: CompletionRequest, raw_request=None):
        """A CompletionResponse, or an async iterator of SSE lines (stream=True)."""
        self.check_model(req.model)
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise OpenAIError("echo with logprobs is not supported (prompt logprobs are not computed)",
                              param="echo")
        if req.max_tokens is not None and req.max_tokens < 1:
            raise OpenAIError(f"max_tokens must be an integer >= 1, got {req.max_tokens}", param="max_tokens")
        if req.use_beam_search:
            self.check_beam_search(req)
        with bad_input_is_400():
            req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs)  # the values, first
        prompts = self._prompts(req)
        per_prompt = []
        with bad_input_is_400():
            for text, ids in prompts:
                max_tokens = self.check_context(len(ids), req.max_tokens, "prompt")
                per_prompt.append((text, ids, req.sampling_params(max_tokens=max_tokens, logprobs=req.logprobs)))

        request_id = random_id("cmpl")
        created = int(time.time())
        texts = [t if t is not None else self.tokenizer.decode(ids) for t, ids, _ in per_prompt]
        num_prompt_tokens = sum(len(ids) for _, ids, _ in per_prompt)
        if req.use_beam_search:
            handles = self.start_beam_searches(req, [(ids, p.max_tokens) for _, ids, p in per_prompt], request_id)
            if req.stream:
                return self._beam_stream(req, request_id, created, handles, texts, num_prompt_tokens)
            return await self._beam_full(req, request_id, created, handles, texts, num_prompt_tokens)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = []
        try:
            for i, (_text, ids, params) in enumerate(per_prompt):
                streams.append(self.engine.add_request({"prompt_token_ids": ids}, params,
                                                       f"{request_id}-{i}", kind))
        except BaseException:
            for s in streams:
                s.close()
            raise
        if req.stream:
            return self._stream(req, request_id, created, streams, texts, num_prompt_tokens)
        return await self._full(req, request_id, created, streams, texts, num_prompt_tokens)

    # ------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids, logprobs, offset: int) -> tuple[CompletionLogprobs, int]:
        out = CompletionLogprobs()
        for tid, pos in zip(token_ids, logprobs):
            (sid, slp), _ = self.sampled_and_top(pos, 0)
            tok = self.token_str(sid, slp)
            out.tokens.append(tok)
            out.token_logprobs.append(max(slp.logprob, -9999.0))
            out.top_logprobs.append({self.token_str(t, lp): max(lp.logprob, -9999.0) for t, lp in pos.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out, offset

    # ------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, created, streams, texts, num_prompt_tokens) -> CompletionResponse:
        n = req.n or 1
        finals: dict[int, object] = {}
        async for i, out in self.merge(streams):
            finals[i] = out
        choices = []
        num_gen = 0
        for i in range(len(streams)):
            for c in finals[i].outputs:
                prefix = texts[i] if req.echo else ""
                lp = None
                if req.logprobs is not None and c.logprobs is not None:
                    lp, _ = self._logprobs(c.token_ids, c.logprobs, len(prefix))
                choices.append(CompletionChoice(index=i * n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                num_gen += len(c.token_ids)
        choices.sort(key=lambda ch: ch.index)
        cached = sum(f.num_cached_tokens for f in finals.values())
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_gen,
                          total_tokens=num_prompt_tokens + num_gen,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        return CompletionResponse(id=request_id, created=created, model=self.model_name,
                                  choices=choices, usage=usage)

    # ------------------------------------------------------------ beam search
    async def _beam_full(self, req, request_id, created, handles, texts, num_prompt_tokens) -> CompletionResponse:
        n = req.n or 1
        results = await self.beam_results(handles)
        choices, num_gen = [], 0
        for i, res in enumerate(results):
            prefix = texts[i] if req.echo else ""
            for j, h in enumerate(res.sequences):
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._logprobs(h.tokens, self.beam_logprobs(h), len(prefix))
                choices.append(CompletionChoice(index=i * n + j, text=prefix + h.text, logprobs=lp,
                                                finish_reason=h.finish_reason))
                num_gen += len(h.tokens)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_gen,
                          total_tokens=num_prompt_tokens + num_gen,
                          prompt_tokens_details=PromptTokensDetails(
                              cached_tokens=sum(r.num_cached_tokens for r in results)))
        return CompletionResponse(id=request_id, created=created, model=self.model_name,
                                  choices=choices, usage=usage)

    def _beam_stream(self, req, request_id, created, handles, texts, num_prompt_tokens) -> AsyncIterator[str]:
        """Beam search has no partial output: the final choices, one chunk each, then [DONE]."""
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        return stream_final(lambda: self._beam_full(req, request_id, created, handles, texts, num_prompt_tokens),
                            head, lambda c: c.model_dump(),
                            bool(req.stream_options and req.stream_options.include_usage))

    # ------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, created, streams, texts, num_prompt_tokens) -> AsyncIterator[str]:
        n = req.n or 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        started: set[int] = set()
        offsets: dict[int, int] = {}
        num_gen = 0
        cached = [0] * len(streams)
        merged = self.merge(streams)
        try:
            async for i, out in merged:
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    text = c.text
                    if idx not in started:
                        started.add(idx)
                        if req.echo:
                            text = texts[i] + text
                        offsets[idx] = len(texts[i]) if req.echo else 0
                    num_gen += len(c.token_ids)
                    lp = None
                    if req.logprobs is not None and c.logprobs:
                        lp, offsets[idx] = self._logprobs(c.token_ids, c.logprobs, offsets[idx])
                    if not text and lp is None and c.finish_reason is None:
                        continue
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": self.model_name,
                             "choices": [{"index": idx, "text": text,
                                          "logprobs": lp.model_dump() if lp is not None else None,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = (usage_dict(num_prompt_tokens, num_gen) if continuous else None)
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": usage_dict(num_prompt_tokens, num_gen, sum(cached))})
        except Exception as e:  # the engine died or the server is stopping
            yield sse(stream_error(e).body())
        finally:
            await merged.aclose()
        yield SSE_DONE


