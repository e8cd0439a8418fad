"""LLM: the offline API. `LLM(model=...).generate(prompts, sampling_params)` and `.chat(messages)`;
`LLM(model, runner="pooling").embed(prompts)`."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine.processor import PromptType
from pagedllm.multimodal.chat import (
    chat_placeholder,
    has_image_parts,
    image_part_locations,
    split_image_parts,
    template_takes_parts,
)
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.sampling_params import ParamError, SamplingParams, pooling_params

# OpenAI's chat roles (its "function" role is deprecated): anything else is refused, as OpenAI
# and vLLM refuse it, before a template renders it as text.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {sorted(unknown)}; "
                f"allowed: {sorted(EngineArgs.field_names() - {'model'})}"
            )
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor / pipeline parallelism); they are also
        stopped when the LLM is garbage-collected or the interpreter exits."""
        self.llm_engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's `LLM.reset_prefix_cache`), e.g. between timed runs
        of the same prompts. Between calls no request holds blocks, so it succeeds (True);
        False only while a request is unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. Every prompt is validated before any runs.
        lora_request: a pagedllm.lora.LoRARequest for every prompt, or a list of one (or None)
        per prompt (needs LLM(..., enable_lora=True)). priority: one int per prompt, lower runs
        earlier (needs LLM(..., scheduling_policy="priority"))."""
        self._check_runner("generate", "generate")
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts; give one, or one per prompt"
                )
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(
                f"lora_request has {len(loras)} entries for {len(prompts)} prompts; give one, or one per prompt"
            )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts; give one per prompt")
        return self._submit(prompts, params, use_tqdm, loras, priority)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config
        auto or DIR; vLLM's), the library's own for the rest; what generate() uses when given none."""
        return SamplingParams(**self.llm_engine.config.model_config.sampling_defaults)

    def embed(
        self, prompts: Union[PromptType, Sequence[PromptType]], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (`out.outputs.embedding`), in the order of the prompts;
        needs LLM(..., runner="pooling")."""
        self._check_runner("pooling", "embed")
        prompts = _prompt_list(prompts)
        return self._submit(prompts, [pooling_params()] * len(prompts), use_tqdm)

    def _check_runner(self, runner: str, method: str) -> None:
        have = self.llm_engine.config.model_config.runner
        if have != runner:
            raise ValueError(f"LLM.{method}() needs runner={runner!r}; this LLM was made with runner={have!r}")

    def _submit(
        self,
        prompts: list,
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: Optional[list] = None,
        priority: Optional[Sequence[int]] = None,
    ) -> list:
        engine = self.llm_engine
        loras = loras or [None] * len(prompts)
        priority = [0] * len(prompts) if priority is None else priority
        # Validate all before adding any, so a bad prompt leaves the engine untouched.
        for p, sp, lora, prio in zip(prompts, params, loras, priority):
            engine.processor.process("validate", p, sp, lora_request=lora, priority=prio)
        ids = []
        for p, sp, lora, prio in zip(prompts, params, loras, priority):
            rid = str(self._counter)
            self._counter += 1
            engine.add_request(rid, p, sp, kind=OutputKind.FINAL_ONLY, lora_request=lora, priority=prio)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts, beam_width: int, max_tokens: int, length_penalty: float = 1.0, ignore_eos: bool = False
    ):
        """Beam search per prompt; beams share KV blocks. Returns BeamSearchOutput per prompt,
        its `sequences` best first (as transformers' generate(num_beams=beam_width))."""
        from pagedllm.engine.beam_search import beam_search

        self._check_runner("generate", "beam_search")
        return beam_search(self.llm_engine, _prompt_list(prompts), beam_width, max_tokens, length_penalty, ignore_eos)

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self._image_chat_prompt(c, add_generation_prompt, chat_template)
            if has_image_parts(c)
            else {
                "prompt_token_ids": self.apply_chat_template(
                    c, add_generation_prompt, chat_template, continue_final_message
                )
            }
            for c in convs
        ]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, conv in zip(outs, convs):
            out.prompt = self.get_tokenizer().decode(out.prompt_token_ids)
        return outs

    def _image_chat_prompt(self, conversation, add_generation_prompt: bool, chat_template) -> dict:
        """A conversation with image parts -> {"prompt": the rendered text with one image
        placeholder per image, "multi_modal_data": {"image": [...]}} (the HF processor expands them)."""
        processor = self.llm_engine.processor
        mm = processor.load_mm_processor("messages")
        processor.check_image_count(len(image_part_locations(conversation)), "messages")  # before loading them
        tokenizer = self.get_tokenizer()
        as_parts = template_takes_parts(
            lambda m: apply_chat_template(tokenizer, m, True, chat_template, tokenize=False)
        )
        messages, images = split_image_parts(
            conversation, chat_placeholder(mm), processor.config.model_config.allowed_local_media_path, as_parts
        )
        processor.check_messages_chars(messages)
        text = apply_chat_template(tokenizer, messages, add_generation_prompt, chat_template, tokenize=False)
        return {"prompt": text, "multi_modal_data": {"image": images}}

    def apply_chat_template(
        self, conversation, add_generation_prompt=True, chat_template=None, continue_final_message=False
    ) -> list[int]:
        self.llm_engine.processor.check_messages_chars(conversation)  # before the template renders
        return apply_chat_template(
            self.get_tokenizer(), conversation, add_generation_prompt, chat_template, continue_final_message
        )

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        wanted = set(ids)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(wanted - set(results)))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a list of token ids) or a sequence of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def check_role(role, where: str) -> None:
    """ParamError naming `where` (e.g. messages[0].role) unless `role` is a chat role."""
    if role not in CHAT_ROLES:
        raise ParamError(where, f"{where}: {role!r} is not a chat role; allowed: {', '.join(CHAT_ROLES)}")


def apply_chat_template(
    tokenizer,
    conversation,
    add_generation_prompt=True,
    chat_template=None,
    continue_final_message=False,
    tokenize: bool = True,
    **template_kwargs,
):
    """Token ids of one conversation through the chat template (shared with the server), or its
    text (tokenize=False: a prompt with images goes through the model's processor);
    `template_kwargs` (tools, enable_thinking, ...) are the template's variables."""
    if not isinstance(conversation, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in conversation
    ):
        raise ValueError("messages must be a list of {'role': str, 'content': str} objects")
    for i, m in enumerate(conversation):
        check_role(m["role"], f"messages[{i}].role")
    tok = tokenizer
    if chat_template is None and tok.chat_template is None:
        raise ValueError("the model has no chat template; pass chat_template")
    ids = tok.apply_chat_template(
        conversation,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        tokenize=tokenize,
        return_dict=False,
        **template_kwargs,
    )
    if not tokenize:
        return ids
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
