"""POST /v1/embeddings (a `--runner pooling` server): each input (a string, strings, token ids
or lists of them) -> its pooled vector, as floats or base64 (little-endian float32, as OpenAI
sends it), with the prompt tokens counted in usage. The inputs run as one batch of requests.
`dimensions` keeps a vector's first n values, L2-normalised again when the model's vectors are
(Matryoshka truncation, as OpenAI's text-embedding-3 and vLLM do it)."""

from __future__ import annotations

import base64
import time

import numpy as np

from pagedllm.engine.async_encoder import AsyncEncoderEngine
from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.protocol import EmbeddingRequest, random_id
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError, OpenAIServing
from pagedllm.sampling_params import pooling_params


def encode(vector: list[float], encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def truncate(vector: list[float], dimensions: int, normalize: bool) -> list[float]:
    v = np.asarray(vector[:dimensions], dtype=np.float64)
    return (v / max(np.linalg.norm(v), 1e-12)).tolist() if normalize else v.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    @property
    def is_encoder(self) -> bool:
        return isinstance(self.engine, AsyncEncoderEngine)

    def check_encoder_len(self, num_tokens: int, what: str) -> None:
        """An encoder reads at most max_model_len tokens (no room is kept for a generated one)."""
        if num_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{what} resulted in {num_tokens} tokens. Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )

    async def embed(self, prompts: list[tuple], request_id: str) -> list[list[float]]:
        """Tokenized prompts ((text, ids) pairs) -> their pooled vectors, in order."""
        if self.is_encoder:
            for _, ids in prompts:
                self.check_encoder_len(len(ids), "input")
            return await self.engine.embed([ids for _, ids in prompts])
        for _, ids in prompts:
            self.check_context(len(ids), None, "input")
        streams = []
        try:
            for i, (_, ids) in enumerate(prompts):
                streams.append(
                    self.engine.add_request(
                        {"prompt_token_ids": ids}, pooling_params(), f"{request_id}-{i}", OutputKind.FINAL_ONLY
                    )
                )
        except BaseException:
            for s in streams:
                s.close()
            raise
        vectors: list = [None] * len(streams)
        async for i, out in self.merge(streams):
            vectors[i] = out.outputs.embedding
        return vectors

    async def create_embedding(self, req: EmbeddingRequest, raw_request=None):
        self.check_model(req.model)
        mc = self.engine.config.model_config
        if req.dimensions is not None and not 1 <= req.dimensions <= mc.hidden_size:
            raise OpenAIError(
                f"dimensions must be in [1, {mc.hidden_size}] (the model's hidden size), got {req.dimensions}",
                param="dimensions",
            )
        prompts = self.tokenize_prompts(req.input, req.add_special_tokens, "input")
        request_id = random_id("embd")
        vectors = await self.embed(prompts, request_id)
        if req.dimensions is not None:
            vectors = [truncate(v, req.dimensions, mc.pooler_config.normalize) for v in vectors]
        num_prompt = sum(len(ids) for _, ids in prompts)
        return JSONBody(
            {
                "id": request_id,
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode(v, req.encoding_format)}
                    for i, v in enumerate(vectors)
                ],
                "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt},
            }
        )
