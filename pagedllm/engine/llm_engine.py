"""LLMEngine: the synchronous engine (processor -> EngineCore -> output processor) in one process."""

from __future__ import annotations

import json
import os
from typing import Optional

from transformers import AutoTokenizer

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.profiler import PROFILER
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: str, tokenizer) -> tuple[Optional[int], set[int]]:
    """The tokenizer's EOS, and any others the generation config lists."""
    eos = tokenizer.eos_token_id
    extra: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            g = json.load(f).get("eos_token_id")
        ids = [g] if isinstance(g, int) else list(g or [])
        if eos is None and ids:
            eos = ids[0]
        extra = {i for i in ids if i != eos}
    return eos, extra


def make_requests(
    processor: Processor,
    output_processor: OutputProcessor,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams,
    kind: OutputKind,
    arrival_time: Optional[float] = None,
    lora_request=None,
    priority: int = 0,
) -> list[Request]:
    """Validate and tokenise one request, register it with the output processor, and return
    the core request(s) to add. A request with n > 1 (or best_of) goes to the core as one
    parent: the core computes its prompt once and forks the siblings over the shared blocks;
    the output processor gathers the siblings under request_id. Shared by LLMEngine and AsyncLLM."""
    text, request = processor.process(
        request_id, prompt, params, arrival_time, lora_request=lora_request, priority=priority
    )
    output_processor.add_request(request, text, kind)
    return [request]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs replicas behind the API server's router "
                "(`pagedllm serve --data-parallel-size N`); the offline engine is one replica"
            )
        self.config = config
        model_dir = config.model_config.model
        self.tokenizer = load_tokenizer(model_dir)
        eos, extra = eos_token_ids(model_dir, self.tokenizer)
        self.core = EngineCore(config, eos_ids=({eos} if eos is not None else set()) | extra)
        self.processor = Processor(config, self.tokenizer, eos, extra, self.core.num_blocks, self.core.kv_cache_config)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        kind: OutputKind = OutputKind.CUMULATIVE,
        arrival_time: Optional[float] = None,
        lora_request=None,
        priority: int = 0,
    ) -> None:
        """Validates first (ValueError), so that a bad request never enters the engine."""
        for request in make_requests(
            self.processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            kind,
            arrival_time,
            lora_request,
            priority,
        ):
            self.core.add_request(request)

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        """One engine step. RequestFailedError when the step failed because of a request:
        that request is ended (its siblings too), the others go on in the next steps."""
        try:
            core_outputs = self.core.step()
        except RequestFailedError as e:
            users = [u for u in map(self.output_processor.user_request_id, e.req_ids) if u is not None]
            self.abort_request(users)
            raise RequestFailedError(users, str(e), e.client_error) from e
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        PROFILER.mark("output_processing")
        PROFILER.end_step()
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        # Not the core's KV transfers (P/D): offline, a later call's steps end them.
        return self.core.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the worker processes of a split model (tensor / pipeline parallelism)."""
        self.core.shutdown()

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions
