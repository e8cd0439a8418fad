"""Request bodies of the scoring endpoints (a `--runner pooling` server): /score (vLLM's text
pairs), /v1/rerank and /rerank (Jina's and Cohere's shape), /pooling (vLLM's raw vectors),
/classify (vLLM's: a classification model's class probabilities)."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import StrictBool, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, PromptInput


class ScoreRequest(OpenAIBaseModel):
    """text_1 against each of text_2: one-to-one, one-to-many, or pairwise (equal lengths)."""

    model: Optional[StrictStr] = None
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]


class RerankDocument(OpenAIBaseModel):
    text: StrictStr


class RerankRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    query: StrictStr
    documents: list[Union[StrictStr, RerankDocument]]
    top_n: Optional[StrictInt] = None  # None: every document
    return_documents: StrictBool = True


class PoolingRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    input: PromptInput
    add_special_tokens: StrictBool = True


class ClassifyRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    input: PromptInput
    add_special_tokens: StrictBool = True
    user: Optional[StrictStr] = None
