"""The OpenAI API's request and response bodies (the subset pagedllm serves), as pydantic models.

Requests are strict about types (a string is not a number, 1 is not true) and reject NaN /
infinity, as OpenAI does; unknown fields are ignored, as vLLM does. Range checks that the
engine also makes (SamplingParams) are left to it, so that there is one source of truth and
one wording; the few here guard what would otherwise reach the engine unchecked.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from pagedllm.sampling_params import ParamError, SamplingParams, StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PROMPTS = 2048  # prompts in one completion request (the sampling fields' bounds: SamplingParams)
# Beam search is deterministic and ends on EOS or max_tokens alone: a field that would change
# the result is refused (400 naming it) unless it has one of these neutral values.
_BEAM_NEUTRAL = {
    "temperature": (None, 0),
    "top_p": (None, 1),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "stop": (None, []),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "best_of": (None,),
    "top_logprobs": (None, 0),
    "response_format": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}

Number = Union[StrictInt, StrictFloat]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ shared
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


def usage_dict(prompt: int, gen: int, cached: Optional[int] = None) -> dict:
    """A usage object for a stream chunk; the final one also says how much of the prompt was cached."""
    u = {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Prompt tokens found in the prefix cache (as OpenAI reports cached input).
    prompt_tokens_details: Optional[PromptTokensDetails] = None


# ------------------------------------------------------------------ structured output
class JsonSchemaFormat(OpenAIBaseModel):
    name: StrictStr = "response"
    description: Optional[StrictStr] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(OpenAIBaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    json_: Optional[Union[StrictStr, dict[str, Any]]] = Field(default=None, alias="json")
    regex: Optional[StrictStr] = None
    choice: Optional[list[StrictStr]] = None
    grammar: Optional[StrictStr] = None
    json_object: Optional[StrictBool] = None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's and the vLLM extras)."""

    model: Optional[StrictStr] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    n: Optional[StrictInt] = 1
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Number] = 0.0
    frequency_penalty: Optional[Number] = 0.0
    logit_bias: Optional[dict[StrictStr, Number]] = None
    user: Optional[StrictStr] = None
    # Extras (vLLM's names).
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[StrictInt]] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # vLLM's beam search: n is the beam width, the n best hypotheses are the choices.
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0
    # vLLM's: the prompt tokens' logprobs with the top k (not while streaming, as vLLM).
    prompt_logprobs: Optional[StrictInt] = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* (one of them).
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    guided_json: Optional[Union[StrictStr, dict[str, Any]]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    # vLLM's P/D field: {"do_remote_decode": true} on a prefill; the prefill response's value on
    # the decode request.
    kv_transfer_params: Optional[dict[str, Any]] = None
    # vLLM's: lower runs earlier, under --scheduling-policy priority.
    priority: StrictInt = 0

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The constraint asked for, validated by the grammar compiler; ParamError naming the
        field (response_format, structured_outputs, guided_*) with the compiler's message."""
        specs: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ParamError(
                    "response_format",
                    "response_format of type json_schema needs json_schema.schema (a JSON schema object)",
                )
            specs.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            kw = self.structured_outputs.model_dump(exclude_none=True)
            specs.append(("structured_outputs", {("json" if k == "json_" else k): v for k, v in kw.items()}))
        specs += [
            (name, {kind: getattr(self, name)}) for name, kind in _GUIDED.items() if getattr(self, name) is not None
        ]
        if not specs:
            return None
        if len(specs) > 1:
            raise ParamError(
                specs[1][0],
                f"only one of response_format, structured_outputs and guided_* may "
                f"constrain the output; got {specs[0][0]} and {specs[1][0]}",
            )
        param, kw = specs[0]
        try:
            params = StructuredOutputsParams(**kw)
        except ParamError as e:
            raise ParamError(param, f"{param}: {e}") from None
        from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs

        validate_structured_outputs(params, param)
        return params

    def beam_search_conflict(self) -> Optional[str]:
        """The first field set to a value that beam search cannot honour, if any."""
        logprobs = getattr(self, "logprobs", None)
        if not isinstance(logprobs, bool) and logprobs not in (None, 0):  # chat's is a flag
            return "logprobs"  # a search reports its chosen tokens' logprobs only
        for name, neutral in _BEAM_NEUTRAL.items():
            if name in type(self).model_fields and getattr(self, name) not in neutral:
                return name
        return None

    def sampling_params(
        self,
        max_tokens: Optional[int],
        logprobs: Optional[int],
        prompt_logprobs: Optional[int] = None,
        defaults: Optional[dict] = None,
    ) -> SamplingParams:
        """ValueError (from SamplingParams) on an out-of-range value. `defaults`: the model's
        sampling defaults (--generation-config) for the fields the request leaves unset."""
        d = defaults or {}

        def pick(name: str, neutral):
            value = getattr(self, name)
            return d.get(name, neutral) if value is None else value

        top_k = pick("top_k", -1)
        return SamplingParams(
            prompt_logprobs=prompt_logprobs,
            n=self.n if self.n is not None else 1,
            best_of=getattr(self, "best_of", None),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k,
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=self.structured_outputs_params(),
            extra_args=None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params},
        )


# ------------------------------------------------------------------ completions
PromptInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None
    add_special_tokens: StrictBool = True


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


# vLLM's `prompt_logprobs` in a response: None for the first prompt token, then
# {token id: {"logprob", "rank", "decoded_token"}} per token.
PromptLogprobsJSON = Optional[list[Optional[dict[str, dict[str, Any]]]]]


def prompt_logprobs_json(plps) -> PromptLogprobsJSON:
    """RequestOutput.prompt_logprobs as vLLM's server writes them."""
    if plps is None:
        return None
    return [
        None
        if pos is None
        else {
            str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in pos.items()
        }
        for pos in plps
    ]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: PromptLogprobsJSON = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: a prefill's KV, for the decode instance


# ------------------------------------------------------------------ chat
class ImageURL(OpenAIBaseModel):
    url: StrictStr
    detail: Optional[StrictStr] = None  # OpenAI's "auto" / "low" / "high": the model's processor decides


class ContentPart(OpenAIBaseModel):
    type: StrictStr
    text: Optional[StrictStr] = None
    image_url: Optional[ImageURL] = None  # type "image_url": multimodal/media.py loads it


class FunctionCall(OpenAIBaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: StrictStr = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's calls, back in the history
    tool_call_id: Optional[StrictStr] = None  # a tool message: the call it answers

    def text(self) -> Optional[str]:
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ValueError(f"message content of type {p.type!r} is not supported (text only)")
            parts.append(p.text)
        return "\n".join(parts)

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)


class FunctionDefinition(OpenAIBaseModel):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: StrictStr


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: Optional[list[ChatLogprobContent]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: PromptLogprobsJSON = None  # vLLM's extra (the request's prompt_logprobs)
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: a prefill's KV, for the decode instance


# ------------------------------------------------------------------ tokenizer endpoints
class TokenizeRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


# ------------------------------------------------------------------ embeddings
class EmbeddingRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[StrictStr] = None
    add_special_tokens: StrictBool = True  # vLLM's extra
