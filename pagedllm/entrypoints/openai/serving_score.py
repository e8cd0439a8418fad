"""/score, /v1/rerank (and /rerank), /pooling on a `--runner pooling` server.

An embedding model scores a pair of texts by the cosine of their pooled vectors (what vLLM does
for a model without a classification head): each distinct text is embedded once, in one batch.
A cross-encoder (an encoder with a one-label classification head) reads each pair as one input,
[CLS] text_1 [SEP] text_2 [SEP] with token types 0 / 1, and scores it by the sigmoid of its logit
(as sentence-transformers' CrossEncoder and vLLM do).
Rerank is a query scored against each document, sorted best first, cut to top_n."""

from __future__ import annotations

import time

import numpy as np

from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_score import PoolingRequest, RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError


def score_pairs(text_1, text_2) -> list[tuple[str, str]]:
    """vLLM's pairing: one-to-one, one text_1 against each text_2, or equal-length lists pairwise."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left:
        raise OpenAIError("text_1 must not be empty", param="text_1")
    if not right:
        raise OpenAIError("text_2 must not be empty", param="text_2")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise OpenAIError(
            f"text_2 must hold one text per text_1 ({len(left)}) or text_1 a single text, got {len(right)}",
            param="text_2",
        )
    return list(zip(left, right))


def cosine(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


class OpenAIServingScore(OpenAIServingEmbedding):
    async def _scores(self, pairs: list[tuple[str, str]], request_id: str, param: str) -> tuple[list[float], int]:
        """-> each pair's score (a cross-encoder's, else the cosine), and the prompt tokens read."""
        if self.is_encoder and self.engine.config.model_config.is_classifier:
            return await self._cross_scores(pairs, param)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # distinct, in order
        prompts = self.tokenize_prompts(texts, True, param)
        vectors = dict(zip(texts, await self.embed(prompts, request_id)))
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(ids) for _, ids in prompts)

    async def _cross_scores(self, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
        mc = self.engine.config.model_config
        if mc.num_labels != 1:
            raise OpenAIError(
                f"this classifier has {mc.num_labels} labels, so no single score per pair: "
                f"/score and /rerank need a one-label cross-encoder (/classify gives every label)",
                param="model",
            )
        inputs = []
        for a, b in pairs:
            try:
                ids, types = self.engine.processor.tokenize_pair(a, b)
            except ValueError as e:
                raise OpenAIError(str(e), param=param) from None
            self.check_encoder_len(len(ids), param)
            inputs.append((ids, types))
        logits = np.asarray(await self.engine.classify(inputs), dtype=np.float64)[:, 0]  # [num_pairs]
        return (1 / (1 + np.exp(-logits))).tolist(), sum(len(ids) for ids, _ in inputs)

    async def create_score(self, req: ScoreRequest, raw_request=None):
        self.check_model(req.model)
        request_id = random_id("score")
        scores, n = await self._scores(score_pairs(req.text_1, req.text_2), request_id, "text_2")
        return JSONBody(
            {
                "id": request_id,
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    async def create_rerank(self, req: RerankRequest, raw_request=None):
        self.check_model(req.model)
        if not req.documents:
            raise OpenAIError("documents must not be empty", param="documents")
        if req.top_n is not None and req.top_n < 1:
            raise OpenAIError(
                f"top_n must be at least 1 (or absent for every document), got {req.top_n}", param="top_n"
            )
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        request_id = random_id("rerank")
        scores, n = await self._scores([(req.query, d) for d in docs], request_id, "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n]
        results = []
        for i in order:
            r = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                r["document"] = {"text": docs[i]}
            results.append(r)
        return JSONBody(
            {
                "id": request_id,
                "model": self.model_name,
                "results": results,
                "usage": {"total_tokens": n},
                "meta": {"billed_units": {"search_units": 1}},
            }
        )

    async def create_pooling(self, req: PoolingRequest, raw_request=None):
        self.check_model(req.model)
        prompts = self.tokenize_prompts(req.input, req.add_special_tokens, "input")
        request_id = random_id("pool")
        vectors = await self.embed(prompts, request_id)
        n = sum(len(ids) for _, ids in prompts)
        return JSONBody(
            {
                "id": request_id,
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )
