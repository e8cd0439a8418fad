"""LLMEngine: the synchronous engine (processor -> EngineCore -> output processor) in one process."""
from __future__ import annotations

import itertools
import json
import os
from typing import Optional

from transformers import AutoTokenizer

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.outputs import RequestOutput
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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model_config.model
        self.tokenizer = load_tokenizer(model_dir)
        eos, extra = eos_token_ids(model_dir, self.tokenizer)
        self.core = EngineCore(config, eos_ids=({eos} if eos is not None else set()) | extra)
        self.processor = Processor(config, self.tokenizer, eos, extra, self.core.num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    kind: OutputKind = OutputKind.CUMULATIVE, arrival_time: Optional[float] = None) -> None:
        """Validates first (ValueError), so that a bad request never enters the engine."""
        text, request = self.processor.process(request_id, prompt, params, arrival_time)
        n = params.n
        if n == 1:
            self.output_processor.add_request(request, text, kind)
            self.core.add_request(request)
            return
        parent = ParentRequest(request_id, n)
        children = []
        for i in range(n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + i
            _, child = self.processor.process(f"{i}_{request_id}", request.prompt_token_ids,
                                              child_params, arrival_time)
            children.append(child)
        self.output_processor.parents[request_id] = parent
        for i, child in enumerate(children):
            self.output_processor.add_request(child, text, kind, parent, i)
            self.core.add_request(child)

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions
