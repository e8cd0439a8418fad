"""POST /classify (vLLM's shape) on a sequence-classification model served as an encoder: each
input -> its class probabilities (softmax over the labels; the sigmoid of a one-label head, as
vLLM does), the most probable label's name (config id2label) and the number of classes."""

from __future__ import annotations

import time

import numpy as np

from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_score import ClassifyRequest
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError


def class_probs(logits: np.ndarray) -> np.ndarray:
    """[N, num_labels] logits -> probabilities: softmax, or the sigmoid of a single label."""
    if logits.shape[1] == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class OpenAIServingClassify(OpenAIServingEmbedding):
    async def create_classify(self, req: ClassifyRequest, raw_request=None):
        self.check_model(req.model)
        mc = self.engine.config.model_config
        if not (self.is_encoder and mc.is_classifier):
            raise OpenAIError(
                "/classify needs a sequence-classification model (an encoder "
                "*ForSequenceClassification); this model has no classification head",
                param="model",
            )
        prompts = self.tokenize_prompts(req.input, req.add_special_tokens, "input")
        for _, ids in prompts:
            self.check_encoder_len(len(ids), "input")
        logits = await self.engine.classify([(ids, [0] * len(ids)) for _, ids in prompts])
        probs = class_probs(np.asarray(logits, dtype=np.float64))  # [N, num_labels]
        n = sum(len(ids) for _, ids in prompts)
        return JSONBody(
            {
                "id": random_id("classify"),
                "object": "list",
                "created": int(time.time()),
                "model": self.model_name,
                "data": [
                    {"index": i, "label": mc.label(int(p.argmax())), "probs": p.tolist(), "num_classes": len(p)}
                    for i, p in enumerate(probs)
                ],
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
            }
        )
