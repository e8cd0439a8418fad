"""ModelRunner: keeps the persistent InputBatch in step with the scheduler, runs the model
over the paged KV cache, and samples the rows whose prefill is complete."""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import numpy as np
import torch

from pagedllm.attention.kv_cache_spec import MambaSpec, MLAAttentionSpec
from pagedllm.attention.kv_quant import check_kv_cache_cast, resolve_kv_cache_dtype
from pagedllm.attention.layer import bind_kv_cache, get_kv_cache_spec
from pagedllm.attention.selector import get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.forward_context import set_forward_context
from pagedllm.lora.worker_manager import make_lora_manager
from pagedllm.models.cpu_decode_loop import build_decode_loop
from pagedllm.models.cpu_ops import cpu_ops
from pagedllm.models.layers.mamba.state_layer import state_layers
from pagedllm.models.loader import load_model
from pagedllm.profiler import PROFILER
from pagedllm.worker.async_output import AsyncOutputs
from pagedllm.worker.bidirectional import bidirectional_spans
from pagedllm.worker.encoder_cache import EncoderCache
from pagedllm.worker.fault_injection import FaultInjector
from pagedllm.worker.mrope import step_mrope_positions
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.runner_output import to_runner_output
from pagedllm.worker.kv_cache_groups import assign_kv_cache_groups, build_step_metadata, kv_cache_config_of_specs
from pagedllm.worker.memory import MemorySnapshot
from pagedllm.worker.pinned_staging import PinnedStaging
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.prompt_logprobs import compute_prompt_logprobs
from pagedllm.worker.sampler import Sampler, SamplingMetadata, apply_grammar_bitmask
from pagedllm.worker.spec_decode import SpecDecoder, expanded_metadata
from pagedllm.worker.state_cache import bind_state_cache, state_kv_cache_layout

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel=None, eos_token_ids: Iterable[int] = ()) -> None:
        """parallel (distributed.parallel_state.ParallelContext): this rank's shard of a model
        split by tensor / pipeline parallelism (worker/parallel_model_runner.py); None: the
        whole model. eos_token_ids: kept out by the sampler until a request's min_tokens."""
        self.config = config
        self.parallel = parallel
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        dc = config.device_config
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.vocab_size
        self.device = torch.device(dc.device)
        # --seed: requests without a seed of their own draw from torch's global generator, so
        # the same engine seed gives the same run (vLLM's set_random_seed).
        torch.manual_seed(mc.seed)
        # Snapshots around the load: worker/memory.py counts as weights only what it added.
        self.memory_baseline = MemorySnapshot.take(self.device)
        self.model = load_model(mc, parallel, dc.device, dc.attention_backend)
        # Vision-language models: image features by content hash (worker/encoder_cache.py).
        self.encoder_cache = (
            EncoderCache(self.model)
            if hasattr(self.model, "encode_images") or hasattr(self.model, "encode_image_list")
            else None
        )
        # --enable-lora: the adapter slots, wrapped around the linears' methods (pagedllm/lora).
        self.lora_manager = make_lora_manager(self.model, config, self.device)
        self.memory_after_load = MemorySnapshot.take(self.device)
        self.memory_profile = None  # worker/memory.MemoryProfile, once profiled
        self.dtype = next(self.model.parameters()).dtype
        # The backend the model's Attention layers were built with (the selector caches it).
        self.attn_backend = get_attn_backend(self.device, self.dtype, dc.attention_backend)
        # This rank's KV cache, as its layers declare it: the layers of its pipeline stage, the
        # KV heads of its TP share.
        # --kv-cache-dtype int8 / fp8: quantized K/V with per-token scales (attention/kv_quant.py).
        self.kv_cache_dtype = resolve_kv_cache_dtype(cc.cache_dtype, self.dtype)
        self.kv_cache_spec = list(get_kv_cache_spec(self.model, cc.block_size, self.kv_cache_dtype).values())
        mla = any(isinstance(spec, MLAAttentionSpec) for spec in self.kv_cache_spec)
        why_not = "MLA layers" if mla else "recurrent layers" if state_layers(self.model) else ""
        check_kv_cache_cast(self.kv_cache_dtype, self.dtype, self.device.type, why_not)
        # KV cache groups (core/kv_cache_utils.py), from the layers' specs; the executor hands
        # this layout to the engine core. With several, kv_cache_spec is one spec per shared
        # tensor, and every attention layer knows its tensor and group.
        # Recurrent layers (Mamba2, LFM2's convolutions) add state groups (worker/state_cache.py).
        if state_layers(self.model):
            self.kv_cache_config, self.kv_cache_spec = state_kv_cache_layout(
                self.model, self.kv_cache_spec, cc.block_size, self.kv_cache_dtype
            )
        else:
            self.kv_cache_config = kv_cache_config_of_specs(
                self.kv_cache_spec, config.parallel_config.pipeline_parallel_size > 1
            )
            if self.kv_cache_config.is_hybrid:
                self.kv_cache_spec = assign_kv_cache_groups(self.model, self.kv_cache_config, self.kv_cache_spec)
        self.num_kv_cache_groups = len(self.kv_cache_config.kv_cache_groups)
        self.num_kv_heads = (
            mc.hf_config.get("num_key_value_heads", mc.hf_config.get("num_attention_heads", 0))
            if parallel is None
            else parallel.shard.num_kv_heads
        )
        # Small CPU decode steps: every layer in one C++ call (None where it does not apply).
        self.decode_loop = build_decode_loop(self.model, self.attn_backend) if parallel is None else None
        self.graphs = None  # worker/cuda_graph.CudaGraphs, made once the KV cache exists
        # The sampled rows' indices go to the device through a page-locked buffer (no stream sync).
        self.index_staging = PinnedStaging({"logits_indices": ((sc.max_num_seqs,), torch.int64)}, self.device)
        # --async-scheduling: sampled tokens stay on the device until the host needs them.
        self.async_outputs = AsyncOutputs(self, sc.max_num_seqs) if sc.async_scheduling else None
        self.input_batch = InputBatch(sc.max_num_seqs, mc.max_model_len, cc.block_size, self.num_kv_cache_groups)
        self.requests: dict[str, CachedRequestState] = {}
        self.faults = FaultInjector.from_env()  # tests only (PAGEDLLM_FAULT_INJECTION)
        self.sampler = Sampler(cpu_ops() if self.device.type == "cpu" else None)
        # --runner pooling: prompts are pooled, never sampled (worker/pooler.py).
        self.pooler = Pooler(mc.pooler_config) if mc.runner == "pooling" else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.eos_ids = frozenset(eos_token_ids)
        # Seeded requests' generators live until the request finishes, across preemption,
        # so that a preempted request continues the same random stream.
        self.generators: dict[str, torch.Generator] = {}
        # Speculative decoding (worker/spec_decode.py): verify drafts, propose the next ones.
        self.spec_decoder = (
            SpecDecoder(config.speculative_config, self.model, self.attn_backend, config)
            if config.speculative_config
            else None
        )
        # A draft with a paged cache of its own: its layers' tensors after the target's, same blocks.
        self.num_target_kv_tensors = len(self.kv_cache_spec)
        if self.spec_decoder is not None and self.spec_decoder.paged is not None:
            self.kv_cache_spec += self.spec_decoder.paged.kv_cache_spec(cc.block_size, self.kv_cache_dtype)

    # ------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_spec)

    def alloc_kv_caches(self, num_blocks: int, device, pin: bool = False):
        """Each layer's tensors as its spec shapes them (full attention: (K, V), each
        [num_blocks * block_size, num_kv_heads, head_dim]; MLA: (latent,), [num_blocks *
        block_size, kv_lora_rank + qk_rope_head_dim]). On the CPU torch.zeros maps pages
        lazily: unused blocks cost no memory until written."""
        return [
            tuple(
                torch.zeros(shape, dtype=dt, device=device, pin_memory=pin) for shape, dt in spec.kv_tensors(num_blocks)
            )
            for spec in self.kv_cache_spec
        ]

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """The KV cache, the swap space (host memory, pinned when the cache is on a GPU), and
        then the decode CUDA graphs, which capture the cache's addresses."""
        self.kv_caches = self.alloc_kv_caches(num_blocks, self.device)
        self.bind_kv_caches(self.kv_caches)
        self.cpu_caches = (
            self.alloc_kv_caches(num_cpu_blocks, "cpu", pin=self.device.type == "cuda") if num_cpu_blocks else []
        )
        dc = self.config.device_config
        mtp = (
            self.spec_decoder is not None
            and self.spec_decoder.paged is not None
            and self.spec_decoder.paged.needs_target_hidden
        )  # reads the eager forward's hidden states
        if (
            self.device.type == "cuda"
            and self.attn_backend.supports_cuda_graphs
            and dc.cuda_graph_sizes
            and self.num_kv_cache_groups == 1
            and not mtp  # a captured step has one block table
            and not self.kv_cache_config.has_state  # and attention metadata only
            and not getattr(self.model, "uses_mrope", False)
        ):  # and positions [T], not M-RoPE's [3, T]
            from pagedllm.worker.cuda_graph import CudaGraphs

            self.graphs = CudaGraphs(self, dc.cuda_graph_sizes, dc.mixed_graph_sizes, capture=True)

    def bind_kv_caches(self, kv_caches: list) -> None:
        """The target's layers take the first tensors, a paged draft's the rest ([] unbinds)."""
        n = self.num_target_kv_tensors
        bind_kv_cache(self.model, kv_caches[:n])
        if self.kv_cache_config.has_state:  # rows of blocks, or of token slots
            rows_per_block = 1 if isinstance(self.kv_cache_spec[0], MambaSpec) else self.block_size
            bind_state_cache(self.model, kv_caches[:n], kv_caches[0][0].shape[0] // rows_per_block if kv_caches else 0)
        if self.spec_decoder is not None and self.spec_decoder.paged is not None:
            self.spec_decoder.paged.bind_kv_cache(kv_caches[n:])

    def profile_kv_cache_memory(self) -> int:
        """GPU: bytes left for the KV cache (see worker/memory.py)."""
        from pagedllm.worker.memory import profile_kv_cache_memory

        return profile_kv_cache_memory(self)

    # ------------------------------------------------------------ states
    def reset(self) -> None:
        """Forget every row and request state, after a step that failed half done: the
        scheduler sends each live request again, whole, as new. Seeded requests keep their
        generators (they go on with the same random stream, as after a preemption)."""
        b = self.input_batch
        self.input_batch = InputBatch(b.max_num_reqs, b.max_model_len, b.block_size, b.num_kv_cache_groups)
        self.requests.clear()
        if self.async_outputs is not None:
            self.async_outputs.reset()

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        gone = so.finished_req_ids | so.preempted_req_ids
        for req_id in gone:
            self.requests.pop(req_id, None)
        for req_id in so.finished_req_ids:
            self.generators.pop(req_id, None)
        if self.encoder_cache is not None and gone:
            self.encoder_cache.forget(gone)
        # Rows not scheduled this step leave the batch (their state stays in self.requests).
        scheduled = so.num_scheduled_tokens
        batch.remove_requests([r for r in list(batch.req_id_to_index) if r in gone or r not in scheduled])
        for data in so.scheduled_cached_reqs:
            state = self.requests[data.req_id]
            state.num_computed_tokens = data.num_computed_tokens
            state.block_ids.extend(data.new_block_ids)
            for ids, new in zip(state.extra_block_ids, data.new_block_ids_by_group[1:]):
                ids.extend(new)
            row = batch.req_id_to_index.get(data.req_id)
            if row is None:
                state.token_ids.extend(data.new_token_ids)
                batch.add_request(state)
            else:
                batch.num_computed_tokens_cpu[row] = data.num_computed_tokens
                batch.append_block_ids(row, data.new_block_ids)
                batch.append_extra_block_ids(row, data.new_block_ids_by_group[1:])
                for t in data.new_token_ids:
                    batch.append_token(row, t)
        for data in so.scheduled_new_reqs:
            params = data.sampling_params
            gen = self.generators.get(data.req_id)
            if gen is None and params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed)
                self.generators[data.req_id] = gen
            state = CachedRequestState(
                data.req_id,
                list(data.token_ids),
                data.num_prompt_tokens,
                params,
                list(data.block_ids),
                data.num_computed_tokens,
                gen,
                data.lora_request,
                extra_block_ids=[list(ids) for ids in data.block_ids_by_group[1:]],
                mm_inputs=data.mm_inputs,
            )
            if data.mm_inputs and getattr(self.model, "uses_mrope", False):
                table, delta = self.model.image_positions(data.num_prompt_tokens, data.mm_inputs)
                state.mrope = (torch.from_numpy(table), delta)
            self.requests[data.req_id] = state
            batch.add_request(state)

    # ------------------------------------------------------------ step
    def _copy_blocks(self, pairs: list[tuple[int, int]], src_caches, dst_caches) -> None:
        """Every layer's cache tensors (K and V, or MLA's latent, or a recurrent layer's state
        tensors, whose rows are blocks) of block src into block dst (copy-on-write, swap, a
        forked state)."""
        offs = torch.arange(self.block_size)
        src_blocks, dst_blocks = torch.tensor([s for s, _ in pairs]), torch.tensor([d for _, d in pairs])
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        rows = {
            False: (
                (src_blocks[:, None] * self.block_size + offs).reshape(-1).to(src_dev),
                (dst_blocks[:, None] * self.block_size + offs).reshape(-1).to(dst_dev),
            ),
            True: (src_blocks.to(src_dev), dst_blocks.to(dst_dev)),
        }
        # Host -> device may be asynchronous (stream-ordered); device -> host must not be, as
        # the host indexes the result at once.
        async_copy = dst_dev.type == "cuda"
        for spec, layer_src, layer_dst in zip(self.kv_cache_spec, src_caches, dst_caches):
            src, dst = rows[isinstance(spec, MambaSpec)]
            for t_src, t_dst in zip(layer_src, layer_dst):
                t_dst[dst] = t_src[src].to(dst_dev, non_blocking=async_copy)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """-> the step's output; with async scheduling an AsyncModelRunnerOutput (get_output())."""
        out = self._execute_model(so)
        if self.encoder_cache is not None and isinstance(out, ModelRunnerOutput):
            out.encoder_stats = self.encoder_cache.take_step_stats()
        return out

    @torch.inference_mode()
    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.async_outputs is not None:
            self.async_outputs.apply_fetched()
        prepared = self._prepare(so)
        if prepared is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs, meta = prepared
        PROFILER.note_batch(len(inputs.input_ids), len(inputs.req_ids))
        PROFILER.mark("prepare_inputs")
        batch = self.input_batch
        if self.spec_decoder is not None:
            self.spec_decoder.begin_step()
        hidden = self._forward(inputs, meta)
        if self.pooler is not None:
            return self._pool(so, inputs, hidden)
        # Before the sampled tokens are appended: it reads the prompt's tokens of the batch.
        prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, inputs, batch)
        rows, out = inputs.sample_rows.tolist(), None
        spec = so.scheduled_spec_decode_tokens
        if rows and spec:  # drafts to verify: the rejection sampler takes every sampling row
            return self._verify_drafts(so, inputs, hidden, prompt_logprobs)
        if rows:
            logits_indices = self._logits_indices(inputs)
            logits = self.model.compute_logits(hidden[logits_indices])  # [len(rows), V]
            if so.grammar_bitmask is not None:  # structured output: constrained rows only
                apply_grammar_bitmask(
                    logits, so.grammar_bitmask, so.structured_output_request_ids, [inputs.req_ids[r] for r in rows]
                )
            PROFILER.mark("forward")
            out = self.sampler(logits, self._sampling_metadata(inputs.sample_rows))
            PROFILER.mark("sample")
        else:
            PROFILER.mark("forward")
        if self.async_outputs is not None:  # the tokens stay on the device (worker/async_output.py)
            result = self.async_outputs.defer(
                inputs.req_ids, rows, [batch.states[r] for r in rows], out, prompt_logprobs
            )
        else:
            result = to_runner_output(
                inputs.req_ids,
                rows,
                [batch.states[r] for r in rows],
                out,
                lambda row, state, token: batch.append_token(row, token),
            )
            result.prompt_logprobs = prompt_logprobs
        batch.num_computed_tokens_cpu[: batch.num_reqs] += inputs.num_scheduled_tokens.astype(np.int32)
        if self.spec_decoder is not None:
            self._propose(result, rows, inputs)
        PROFILER.mark("runner_update")
        return result

    def _verify_drafts(self, so: SchedulerOutput, inputs, hidden: torch.Tensor, prompt_logprobs) -> ModelRunnerOutput:
        """A step with drafts: the rejection sampler's tokens for each sampling row, the
        rejected drafts' positions rolled back, and the next drafts."""
        batch, spec = self.input_batch, so.scheduled_spec_decode_tokens
        rows = inputs.sample_rows.tolist()

        def grammar(logits, row_req_ids):
            if so.grammar_bitmask is not None:
                apply_grammar_bitmask(logits, so.grammar_bitmask, so.structured_output_request_ids, row_req_ids)

        def metadata(states, drafts):
            return expanded_metadata(states, drafts, self.eos_ids, self.vocab_size, self.device)

        tokens, row_logprobs = self.spec_decoder.sample(
            self.model.compute_logits, hidden, inputs, batch, spec, metadata, grammar
        )
        PROFILER.mark("sample")
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs = [None] * len(inputs.req_ids) if any(lp is not None for lp in row_logprobs) else None
        batch.num_computed_tokens_cpu[: batch.num_reqs] += inputs.num_scheduled_tokens.astype(np.int32)
        for row, new, lp in zip(rows, tokens, row_logprobs):
            sampled[row] = new
            if logprobs is not None:
                logprobs[row] = lp
            for t in new:
                batch.append_token(row, t)
            k = len(spec.get(inputs.req_ids[row], ()))
            batch.num_computed_tokens_cpu[row] -= k + 1 - len(new)  # the rejected drafts' slots
            self.spec_decoder.policy.observe(k, len(new) - 1)
        result = ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )
        self._propose(result, rows, inputs)
        PROFILER.mark("runner_update")
        return result

    def _propose(self, result: ModelRunnerOutput, rows: list[int], inputs) -> None:
        drafts = self.spec_decoder.propose(self.input_batch, rows, inputs)
        result.spec_token_ids = [[] for _ in result.req_ids]
        for row, d in zip(rows, drafts):
            result.spec_token_ids[row] = d

    def _pool(self, so: SchedulerOutput, inputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """A pooling step: each row whose prompt ends here gets its vector instead of a token."""
        batch = self.input_batch
        n = batch.num_reqs
        self.pooler.forget(so.finished_req_ids)
        pooled = self.pooler(hidden, inputs, batch.states[:n], batch.num_computed_tokens_cpu[:n].copy())
        PROFILER.mark("forward")
        batch.num_computed_tokens_cpu[:n] += inputs.num_scheduled_tokens.astype(np.int32)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids], pooler_output=pooled
        )

    def _prepare(self, so: SchedulerOutput):
        """Block copies, the batch brought in step with `so`, and this step's (inputs, attention
        metadata); None when no request runs. Shared with the workers of a split model."""
        # Order matters: a block swapped out this step may be copied or swapped into, and a
        # copy may read a block freed this step (a preempted request's state snapshot, a hit
        # snapshot evicted again) that a swap-in then overwrites; no copy reads a swap-in's
        # blocks (KVCacheManager.swap_in saves no snapshot).
        if so.blocks_to_swap_out:
            self._copy_blocks(so.blocks_to_swap_out, self.kv_caches, self.cpu_caches)
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy, self.kv_caches, self.kv_caches)
        if so.blocks_to_swap_in:
            self._copy_blocks(so.blocks_to_swap_in, self.cpu_caches, self.kv_caches)
        self._update_states(so)
        batch = self.input_batch
        if batch.num_reqs == 0:
            return None
        if self.faults is not None:
            self.faults.check(batch.states[: batch.num_reqs])
        if so.scheduled_spec_decode_tokens:
            SpecDecoder.write_drafts(batch, so.scheduled_spec_decode_tokens)
        inputs = batch.prepare_inputs(so.num_scheduled_tokens)
        lora_active = self.lora_manager is not None and self.lora_manager.set_active_loras(
            [s.lora_request for s in batch.states[: batch.num_reqs]], inputs.num_scheduled_tokens
        )
        if self.graphs is not None and not lora_active and self.graphs.can_run(inputs):
            return inputs, None  # a captured decode step builds its own metadata
        # Several KV cache groups: a list, one per group.
        spans = (
            bidirectional_spans(
                batch.states[: batch.num_reqs], batch.num_computed_tokens_cpu, inputs.num_scheduled_tokens
            )
            if getattr(self.model, "bidirectional_images", False)
            else None
        )
        meta = build_step_metadata(self.attn_backend, inputs, self.block_size, self.kv_cache_config, self.device, spans)
        return inputs, meta

    def _forward(self, inputs, meta) -> torch.Tensor:
        """The model over this step's tokens -> final hidden states [num_tokens, hidden]."""
        if meta is None:
            return self.graphs.run(inputs)
        input_ids = inputs.input_ids.to(self.device, non_blocking=True)
        positions = inputs.positions.to(self.device, non_blocking=True)
        if self.async_outputs is not None:  # tokens of the step in flight, from the device
            self.async_outputs.fill_placeholders(input_ids, inputs)
        with set_forward_context(meta):
            if self.decode_loop is not None and self.decode_loop.applies(meta, input_ids.shape[0]):
                return self.decode_loop(input_ids, positions)  # the layers in one C++ call
            if getattr(self.model, "uses_mrope", False):  # [3, T]: worker/mrope.py
                positions = step_mrope_positions(
                    inputs.positions,
                    inputs.query_start_loc.tolist(),
                    self.input_batch.states[: self.input_batch.num_reqs],
                ).to(self.device)
            return self.model(input_ids, positions, self._embed_images(input_ids, inputs))

    def _embed_images(self, input_ids: torch.Tensor, inputs) -> Optional[torch.Tensor]:
        """The step's input embeddings with image features at the placeholder rows; None when no
        request of the step has images (the model embeds input_ids itself)."""
        batch = self.input_batch
        if self.encoder_cache is None or not any(s.mm_inputs for s in batch.states[: batch.num_reqs]):
            return None
        starts = inputs.query_start_loc.tolist()
        rows = [
            (
                s.req_id,
                s.mm_inputs,
                int(batch.num_computed_tokens_cpu[r]),
                int(inputs.num_scheduled_tokens[r]),
                starts[r],
            )
            for r, s in enumerate(batch.states[: batch.num_reqs])
            if s.mm_inputs
        ]
        return self.encoder_cache.embed(input_ids, rows)

    def _logits_indices(self, inputs) -> torch.Tensor:
        """[sampling rows] token index of each, on the device."""
        return self.index_staging.upload(logits_indices=inputs.logits_indices)[0]

    def _sampling_metadata(self, rows: np.ndarray) -> Optional[SamplingMetadata]:
        """None when every row is plain greedy: the sampler then takes the argmax."""
        states = [self.input_batch.states[r] for r in rows.tolist()]
        if all(s.sampling_params.plain_greedy for s in states):
            return None
        min_tok_stops = []
        for s in states:
            p = s.sampling_params
            stops = set(p.all_stop_token_ids)
            if not p.ignore_eos:
                stops |= self.eos_ids
            min_tok_stops.append(stops)
        output_token_ids = [s.token_ids[s.num_prompt_tokens :] for s in states]
        if self.async_outputs is not None:  # a token still on the device counts too
            output_token_ids = self.async_outputs.complete_output_ids(
                states,
                output_token_ids,
                need_ids=any(
                    p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    for p in (s.sampling_params for s in states)
                ),
            )
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            output_token_ids=output_token_ids,
            generators=[s.generator for s in states],
            stop_ids_for_min_tokens=min_tok_stops,
            vocab_size=self.vocab_size,
            device=self.device,
        )
