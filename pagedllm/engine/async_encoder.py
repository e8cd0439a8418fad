"""AsyncEncoderEngine: what the OpenAI server runs for an encoder model (BERT, XLM-RoBERTa,
ModernBERT) in place of AsyncLLM.

An encoder request is one forward over its whole prompt with nothing decoded after it, so it
needs no KV cache, no paging and no engine core process: the model runs in the server's process,
on one worker thread (torch releases the GIL, so the event loop keeps accepting requests while a
batch runs). Batching across requests: every prompt is queued; the batch loop takes all that
waits (up to max_num_seqs), sorts it by length and runs it in padded forwards of at most
max_num_batched_tokens padded tokens. Prompts that arrive while a batch runs form the next one.

The attributes the server reads from an engine (config.model_config, tokenizer, processor,
max_model_len, metrics, check_health, stop_accepting, ...) are given the same names as
AsyncLLM's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pagedllm.config import PoolerConfig
from pagedllm.engine.exceptions import EngineDeadError, EngineOverloadedError
from pagedllm.metrics import DEFAULT_METRICS_PREFIX, EngineMetrics
from pagedllm.sampling_params import ParamError

logger = logging.getLogger("pagedllm.server")

EMBED, CLASSIFY = "embed", "classify"


@dataclass
class EncoderModelConfig:
    """The fields of ModelConfig the server reads, for an encoder model."""

    model: str
    hf_config: dict = field(repr=False)
    max_model_len: int
    hidden_size: int
    vocab_size: int
    pooler_config: PoolerConfig
    num_labels: int  # 0 for an embedding model
    runner: str = "pooling"
    sampling_defaults: dict = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return (self.hf_config.get("architectures") or ["?"])[0]

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def kind(self) -> str:
        return "a sequence-classification (cross-encoder)" if self.is_classifier else "an embedding"

    @property
    def endpoints(self) -> tuple[str, ...]:
        """What the server answers for this model (a classifier scores pairs with its head)."""
        if self.is_classifier:
            return ("/classify", "/score", "/v1/rerank")
        return ("/v1/embeddings", "/pooling", "/score", "/v1/rerank")

    def label(self, index: int) -> str:
        return (self.hf_config.get("id2label") or {}).get(str(index), f"LABEL_{index}")


@dataclass
class EncoderEngineConfig:
    model_config: EncoderModelConfig
    lora_config: None = None


class EncoderProcessor:
    """The encoder's prompt validation (Processor's methods the server calls)."""

    def __init__(self, tokenizer, config: EncoderModelConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = config.vocab_size
        # No token stands for more characters than the longest vocabulary entry: a longer text
        # cannot fit in max_model_len tokens (refused before the tokenizer runs).
        self.max_prompt_chars = config.max_model_len * max(map(len, tokenizer.get_vocab()), default=1)
        self.max_model_len = config.max_model_len

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise ParamError(
                param,
                f"{param} has {num_chars} characters, more than max_model_len "
                f"({self.max_model_len}) tokens can hold ({self.max_prompt_chars})",
            )

    def check_messages_chars(self, conversation) -> None:
        raise ParamError("messages", "an encoder model has no chat template")

    def tokenize(self, prompt, add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """A string or a list of token ids -> (text or None, token ids)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must be a non-empty string, got ''")
            self.check_prompt_chars(len(prompt))
            return prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt:
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size):
                    raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
            return None, list(prompt)
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")

    def tokenize_pair(self, text_1: str, text_2: str) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: [CLS] text_1 [SEP] text_2 [SEP] -> (token ids, token-type ids 0 / 1)."""
        self.check_prompt_chars(len(text_1) + len(text_2), "text")
        enc = self.tokenizer(text_1, text_2)
        return enc["input_ids"], enc.get("token_type_ids") or [0] * len(enc["input_ids"])


@dataclass
class _Item:
    kind: str
    ids: list[int]
    type_ids: Optional[list[int]]
    future: asyncio.Future


class AsyncEncoderEngine:
    def __init__(
        self,
        model_dir: str,
        model_name: Optional[str] = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 8192,
        max_model_len: Optional[int] = None,
        dtype: str = "float32",
        max_waiting_requests: Optional[int] = None,
        metrics_prefix: str = DEFAULT_METRICS_PREFIX,
    ) -> None:
        """max_num_seqs: most prompts in one batch; max_num_batched_tokens: most padded tokens in one
        forward (a batch longer than that is cut into several forwards, shortest prompts first);
        max_model_len: most tokens of a prompt (default and most: the sentence-transformers
        max_seq_length, else max_position_embeddings); dtype: the weights' and activations' (pooled
        vectors and logits come out float32); max_waiting_requests: most prompts queued and not yet
        running (more: EngineOverloadedError, a 503)."""
        import torch

        from pagedllm.models.encoder_runner import EncoderRunner

        self.runner = EncoderRunner(model_dir, getattr(torch, dtype))
        hf = self.runner.hf_config
        if max_model_len is not None and not 1 <= max_model_len <= self.runner.max_length:
            raise ValueError(
                f"max_model_len must be in [1, {self.runner.max_length}] for this encoder (its "
                f"max_seq_length / max_position_embeddings), got {max_model_len}"
            )
        mc = EncoderModelConfig(
            model=model_dir,
            hf_config=hf,
            max_model_len=max_model_len or self.runner.max_length,
            hidden_size=hf["hidden_size"],
            vocab_size=hf["vocab_size"],
            pooler_config=self.runner.pooler_config,
            num_labels=self.runner.model.classifier.out_features if self.runner.is_classifier else 0,
        )
        self.config = EncoderEngineConfig(mc)
        self.model_name = model_name or model_dir
        self.tokenizer = self.runner.tokenizer
        self.processor = EncoderProcessor(self.tokenizer, mc)
        self.max_model_len = mc.max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_waiting_requests = max_waiting_requests
        self.metrics = EngineMetrics(self.model_name, prefix=metrics_prefix)
        self.num_blocks = 0  # no KV cache
        self.queues: dict = {}  # AsyncLLM's requests in flight: none here (see _waiting)
        self.errored: Optional[BaseException] = None
        self.restart_engine_on_failure = False
        self.on_engine_dead: Optional[Callable[[], None]] = None
        self.num_forwards = self.num_rows = 0  # forwards and prompts run so far (batching shows in them)
        self._waiting: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._stopping = False

    async def start(self) -> None:
        self._waiting = asyncio.Queue()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-encoder")
        self._task = asyncio.get_running_loop().create_task(self._batch_loop(), name="pagedllm-encoder-batches")

    def check_health(self) -> None:
        if self._stopping or self._task is None or self._task.done():
            raise EngineDeadError("the encoder is not running")

    def stop_accepting(self) -> None:
        """Shutdown begins: new requests and the prompts still waiting get EngineDeadError (503)."""
        self._stopping = True
        while self._waiting is not None and not self._waiting.empty():
            future = self._waiting.get_nowait().future
            if not future.done():
                future.set_exception(EngineDeadError("the server is shutting down"))

    async def shutdown(self) -> None:
        self.stop_accepting()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------ requests
    async def embed(self, prompts: Sequence[list[int]]) -> list[list[float]]:
        """Token id lists -> their pooled vectors, in order."""
        return await self._submit([_Item(EMBED, list(p), None, None) for p in prompts])

    async def classify(self, prompts: Sequence[tuple[list[int], list[int]]]) -> list[list[float]]:
        """(token ids, token-type ids) pairs -> their logits [num_labels] each, in order."""
        return await self._submit([_Item(CLASSIFY, list(ids), list(types), None) for ids, types in prompts])

    async def _submit(self, items: list[_Item]) -> list[list[float]]:
        self.check_health()
        if self.max_waiting_requests is not None and self._waiting.qsize() + len(items) > self.max_waiting_requests:
            self.metrics.rejected.labels(self.model_name, "overloaded").inc()
            raise EngineOverloadedError(
                f"The server is overloaded: more than {self.max_waiting_requests} prompts are waiting "
                "(--max-waiting-requests). Please retry later."
            )
        loop = asyncio.get_running_loop()
        for it in items:
            it.future = loop.create_future()
            self._waiting.put_nowait(it)
        try:
            return list(await asyncio.gather(*(it.future for it in items)))
        finally:  # a cancelled request (the client left): its prompts still waiting are skipped
            for it in items:
                it.future.cancel()

    # ------------------------------------------------------------ the batch loop
    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._waiting.get()]
            while not self._waiting.empty() and len(batch) < self.max_num_seqs:
                batch.append(self._waiting.get_nowait())
            batch = [it for it in batch if not it.future.done()]
            for kind in (EMBED, CLASSIFY):
                for chunk in self._chunks([it for it in batch if it.kind == kind]):
                    try:
                        rows = await loop.run_in_executor(self._executor, self._forward, kind, chunk)
                    except Exception as e:  # the request's fault or the model's: those prompts fail
                        logger.error("encoder forward failed: %s: %s", type(e).__name__, e)
                        rows = [e] * len(chunk)
                    for it, row in zip(chunk, rows):
                        if not it.future.done():
                            (it.future.set_exception if isinstance(row, Exception) else it.future.set_result)(row)

    def _chunks(self, items: list[_Item]) -> list[list[_Item]]:
        """Shortest first, cut where the padded size (rows x longest) would pass max_num_batched_tokens."""
        chunks: list[list[_Item]] = []
        for it in sorted(items, key=lambda it: len(it.ids)):
            if chunks and (len(chunks[-1]) + 1) * len(it.ids) <= self.max_num_batched_tokens:
                chunks[-1].append(it)
            else:
                chunks.append([it])
        return chunks

    def _forward(self, kind: str, chunk: list[_Item]) -> list[list[float]]:
        self.num_forwards += 1
        self.num_rows += len(chunk)
        ids = [it.ids for it in chunk]
        if kind == EMBED:
            out = self.runner.embed_ids(ids)  # [B, H]
        else:
            out = self.runner.classify_ids(ids, [it.type_ids for it in chunk])  # [B, num_labels]
        return out.tolist()


def make_async_engine(engine_args, model_name: str, **kwargs):
    """AsyncLLM (an engine core process) for the engine arguments' model, or AsyncEncoderEngine
    when it is an encoder (BERT, XLM-RoBERTa, ModernBERT; a CPU model: dtype auto is float32).
    kwargs: AsyncLLM's options (of which the encoder takes max_waiting_requests, metrics_prefix)."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.models.download import resolve_model
    from pagedllm.models.encoder_runner import is_encoder_dir

    model_dir = resolve_model(engine_args.model, engine_args.quantization)
    if not is_encoder_dir(model_dir):
        return AsyncLLM(engine_args, model_name=model_name, **kwargs)
    return AsyncEncoderEngine(
        str(model_dir),
        model_name,
        max_num_seqs=engine_args.max_num_seqs,
        max_num_batched_tokens=engine_args.max_num_batched_tokens,
        max_model_len=engine_args.max_model_len,
        dtype="float32" if engine_args.dtype == "auto" else engine_args.dtype,
        max_waiting_requests=kwargs.get("max_waiting_requests"),
        metrics_prefix=kwargs.get("metrics_prefix", DEFAULT_METRICS_PREFIX),
    )
