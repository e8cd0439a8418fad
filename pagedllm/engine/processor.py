"""Processor: validates and tokenises a user's request into a core Request, before it enters the
engine. Every rejection is a ValueError that names the field, the value and what is allowed."""

from __future__ import annotations

from typing import Optional, Union

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import check_fits_kv_cache
from pagedllm.core.kv_cache_utils import KVCacheConfig
from pagedllm.engine.compat import check_request
from pagedllm.multimodal.inputs import ProcessedPrompt
from pagedllm.request import Request
from pagedllm.sampling_params import ParamError, SamplingParams

PromptType = Union[str, list[int], dict]


def check_prompt_len(num_prompt_tokens: int, max_model_len: int) -> None:
    """The prompt must leave room for the first generated token: its KV is written at position
    num_prompt_tokens, which must lie inside the context. ValueError otherwise (offline and
    in the server, which words it as OpenAI does)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_model_len ({max_model_len}) "
            f"allows: at most {max_model_len - 1}, so that one token can be generated"
        )


class Processor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        eos_token_id: Optional[int],
        extra_eos_ids: set[int],
        num_blocks: int,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        """num_blocks, kv_cache_config: the engine core's KV cache, for the admission check (a
        sliding group holds its window only)."""
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = extra_eos_ids
        self.num_blocks = num_blocks
        self.vocab_size = config.model_config.vocab_size
        # No token stands for more characters than the longest vocabulary entry (byte-level
        # BPE: its bytes; SentencePiece: "▁" is one space, "<0x41>" one byte), so a text longer
        # than max_model_len such entries cannot fit: it is refused before the tokenizer runs.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = config.model_config.max_model_len * self.max_token_chars
        self.known_loras: dict = {}  # lora_int_id -> the LoRARequest whose directory was checked
        self.mm_processor = None  # the model's HF processor, loaded on the first prompt with images

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """ParamError when a text of num_chars characters cannot fit in max_model_len tokens
        (a tokenizer that drops or merges characters, e.g. whitespace or <unk>, can fit more:
        such a text is refused all the same)."""
        if num_chars > self.max_prompt_chars:
            max_len = self.config.model_config.max_model_len
            raise ParamError(
                param,
                f"{param} has {num_chars} characters, more than max_model_len ({max_len}) "
                f"tokens of at most {self.max_token_chars} characters each can hold "
                f"({self.max_prompt_chars})",
            )

    def check_messages_chars(self, conversation) -> None:
        """check_prompt_chars for chat messages, on the sum of their text before the template
        renders them (the rendered prompt holds at least that text)."""
        messages = conversation if isinstance(conversation, list) else []  # the template's check says why
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        texts = [c for c in contents if isinstance(c, str)] + [  # and text parts (a template that takes parts)
            p["text"]
            for c in contents
            if isinstance(c, list)
            for p in c
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        self.check_prompt_chars(sum(map(len, texts)), "messages")

    def check_structured_outputs(self, params: SamplingParams, beam_width: int = 1) -> None:
        """The spec parses (the compiler's message otherwise), and the request can honour it."""
        from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs

        if beam_width > 1 or params.external_tokens:
            raise ParamError("structured_outputs", "structured_outputs is not supported with beam search")
        if self.config.parallel_config.pipeline_parallel_size > 1:
            raise ParamError("structured_outputs", "structured_outputs is not supported with pipeline parallelism")
        validate_structured_outputs(params.structured_outputs)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """A string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt must have a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must be a non-empty string, got ''")
            self.check_prompt_chars(len(prompt))
            return prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, (list, tuple)):
            if len(prompt) == 0:
                raise ValueError("prompt token ids must be a non-empty list, got []")
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size):
                    raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def load_mm_processor(self, param: str = "multi_modal_data"):
        """The model's HF processor (loaded once); ParamError(param) for a text-only model."""
        if "multimodal_config" not in self.config.model_config.hf_config:
            raise ParamError(param, f"{param}: images need a vision-language model; this model takes text only")
        if self.mm_processor is None:
            from pagedllm.multimodal.processing import load_mm_processor

            mc = self.config.model_config
            self.mm_processor = load_mm_processor(mc.model, (mc.hf_config.get("architectures") or [""])[0])
        return self.mm_processor

    def check_image_count(self, count: int, param: str) -> None:
        """ParamError(param) for more images than --limit-mm-per-prompt allows."""
        from pagedllm.multimodal.limits import check_item_count

        check_item_count(self.config.model_config.limit_mm_per_prompt, "image", count, param)

    def process_images(self, prompt: dict) -> ProcessedPrompt:
        """{"prompt": str, "multi_modal_data": {"image": ...}} -> the text, its token ids (each
        image's placeholder expanded) and the ImageInputs."""
        from pagedllm.multimodal.processing import images_of, process_prompt

        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("a prompt with multi_modal_data must have a non-empty string 'prompt'")
        self.check_prompt_chars(len(text))
        mm = self.load_mm_processor()
        images = images_of(prompt["multi_modal_data"])
        self.check_image_count(len(images), "multi_modal_data")
        ids, mm_inputs = process_prompt(mm, text, images)
        return ProcessedPrompt(text, ids, mm_inputs)

    def check_priority(self, priority) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs --scheduling-policy priority "
                "(this engine schedules first come first served); leave priority 0"
            )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        beam_width: int = 1,
        lora_request=None,
        priority: int = 0,
    ) -> tuple[Optional[str], Request]:
        """`beam_width`: the request is a beam search's first beam (all its beams must fit; the
        scheduler enforces it too, this says so before anything is sent). `lora_request`: the
        adapter it runs with (pagedllm.lora.LoRARequest), checked against the model. `priority`:
        lower runs earlier, under --scheduling-policy priority only (as vLLM)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self.check_priority(priority)
        mm_inputs = ()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            prompt = self.process_images(prompt)
        if isinstance(prompt, ProcessedPrompt):  # the server processes its images before the context check
            text, ids, mm_inputs = prompt.text, prompt.token_ids, prompt.mm_inputs
        else:
            text, ids = self.tokenize(prompt)
        max_len = self.config.model_config.max_model_len
        check_prompt_len(len(ids), max_len)
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {t}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {max(params.logit_bias)}")
        max_seqs = self.config.scheduler_config.max_num_seqs
        if params.num_samples > max_seqs:
            raise ValueError(f"n / best_of ({params.num_samples}) must be <= max_num_seqs ({max_seqs})")
        if beam_width > max_seqs:
            raise ValueError(f"beam_width ({beam_width}) must be <= max_num_seqs ({max_seqs})")
        check_request(self.config, params, beam_width, lora_request)
        if params.structured_outputs is not None:
            self.check_structured_outputs(params, beam_width)
        if lora_request is not None:
            from pagedllm.lora.peft_helper import check_lora_request

            check_lora_request(lora_request, self.config, self.known_loras)
        params = params.clone()
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.extra_eos_ids
        request = Request(request_id, ids, params, eos_token_id=self.eos_token_id, arrival_time=arrival_time)
        request.mm_inputs = mm_inputs
        request.priority = priority
        if lora_request is not None:  # its own KV blocks: the adapter changes every K and V
            request.lora_request = lora_request
            request.extra_keys = request.extra_keys + (("lora", lora_request.lora_int_id),)
        # Never longer than the context, nor than the whole KV cache could ever hold: a beam
        # search's beams wait for each other, so all of them must fit at full length at once.
        room = max_len - len(ids)
        request.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        check_fits_kv_cache(
            len(ids),
            request.max_tokens,
            beam_width,
            self.config.cache_config.block_size,
            self.num_blocks,
            max_len,
            self.kv_cache_config,
            self.config.scheduler_config.max_num_batched_tokens,
        )
        return text, request
