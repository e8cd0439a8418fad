"""The model runner's part of speculative decoding: the scheduled drafts go into the token-id
table after each row's last token (so prepare_inputs feeds them like any token), the target's
logits at every draft position and the bonus position go through the RejectionSampler, and
after the step the proposer drafts the next step's tokens (ModelRunnerOutput.spec_token_ids).

Rows that never speculate: beam search (its tokens are chosen outside) and structured output
(the grammar's mask is per step). Logprobs come from the raw logits at each emitted token's
position, as the sampler's do without drafts (one entry per emitted token)."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_dir_proposer import DraftDirProposer, load_draft_model
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.spec_decode.length_policy import SpecLengthPolicy
from pagedllm.spec_decode.mtp_proposer import MTPProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.paged_draft import PagedDraftProposer
from pagedllm.worker.input_batch import InputBatch, ModelInputs
from pagedllm.worker.rejection_sampler import RejectionSampler
from pagedllm.worker.sampler import SamplingMetadata, gather_logprobs

# Per sampling row: None, or one (ids, logprobs, rank) entry per emitted token (the token first,
# then the top k), as ModelRunnerOutput.logprobs carries them.
RowLogprobs = Optional[list[tuple[list[int], list[float], int]]]


def speculates(params) -> bool:
    return not (params.external_tokens or params.structured_outputs is not None)


def make_proposer(config: SpeculativeConfig, model, attn_backend, engine_config):
    """The proposer the config names (checked by engine/compat.py when the engine config is built)."""
    block_size, max_model_len = engine_config.cache_config.block_size, engine_config.model_config.max_model_len
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model" and config.model.startswith("self:"):
        return DraftModelProposer(model, int(config.model[5:]), attn_backend, block_size, max_model_len)
    if config.method == "draft_model":
        return DraftDirProposer(load_draft_model(engine_config, config.model), attn_backend, block_size, max_model_len)
    from pagedllm.models.deepseek_mtp import DeepSeekMTP
    from pagedllm.models.loader import load_model

    dc = engine_config.device_config
    mtp = load_model(engine_config.model_config, None, dc.device, dc.attention_backend, model_cls=DeepSeekMTP)
    return MTPProposer(mtp, model, attn_backend, block_size, max_model_len)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, model, attn_backend, engine_config) -> None:
        self.config = config
        self.proposer = make_proposer(config, model, attn_backend, engine_config)
        # A proposer with a paged KV cache of its own (spec_decode/paged_draft.py), else None.
        self.paged = self.proposer if isinstance(self.proposer, PagedDraftProposer) else None
        self.policy = SpecLengthPolicy(config.num_speculative_tokens, config.length_policy == "adaptive")
        self.rejection_sampler = RejectionSampler()
        self.step_start = 0.0

    def begin_step(self) -> None:
        """The model is about to run: the step's cost is timed from here to the next proposal."""
        self.step_start = time.perf_counter()

    @staticmethod
    def write_drafts(batch: InputBatch, spec: dict[str, list[int]]) -> None:
        """Each scheduled draft into its row's token-id table after the last token (num_tokens is
        not moved: the accepted ones are appended after the step, over them)."""
        for req_id, drafts in spec.items():
            row = batch.req_id_to_index[req_id]
            n = batch.num_tokens[row]
            batch.token_ids_np[row, n : n + len(drafts)] = drafts

    def sample(
        self,
        compute_logits,
        hidden: torch.Tensor,
        inputs: ModelInputs,
        batch: InputBatch,
        spec: dict[str, list[int]],
        metadata_fn,
        grammar_fn,
    ) -> tuple[list[list[int]], list[RowLogprobs]]:
        """The tokens of each sampling row (inputs.sample_rows): accepted drafts + one sampled;
        and each row's logprobs (None where its request asked for none)."""
        rows = inputs.sample_rows.tolist()
        drafts = [spec.get(inputs.req_ids[r], []) for r in rows]
        ks = np.array([len(d) for d in drafts], dtype=np.int64)  # [R]
        last = inputs.logits_indices.numpy()  # [R] last token of each row
        # The k + 1 positions each row is scored at: its last real token and every draft.
        group = ks + 1
        starts = np.cumsum(group) - group  # [R]
        offsets = np.arange(int(group.sum())) - np.repeat(starts, group)  # 0..k per row
        positions = np.repeat(last - ks, group) + offsets  # [N]
        logits = compute_logits(hidden[torch.from_numpy(positions).to(hidden.device)])  # [N, V]
        grammar_fn(logits, [inputs.req_ids[r] for r, k in zip(rows, ks.tolist()) for _ in range(k + 1)])
        states = [batch.states[r] for r in rows]
        md = metadata_fn(states, drafts)
        ks_lp = [s.sampling_params.logprobs for s in states]
        want = [b for b, k in enumerate(ks_lp) if k is not None]
        raw = None
        if want:  # before the sampler's processors touch the logits
            sel = np.concatenate([starts[b] + np.arange(group[b]) for b in want])
            raw = torch.log_softmax(logits[torch.from_numpy(sel).to(logits.device)].float(), dim=-1)  # [M, V]
        tokens = self.rejection_sampler(logits, drafts, md, [s.generator for s in states])
        logprobs: list[RowLogprobs] = [None] * len(rows)
        if raw is not None:
            # Row b's emitted tokens sit at its first len(tokens[b]) scored positions.
            scored = group[want]  # each wanting row's positions in raw
            offs = np.cumsum(scored) - scored
            pick = np.concatenate([offs[i] + np.arange(len(tokens[b])) for i, b in enumerate(want)])
            emitted = torch.tensor([t for b in want for t in tokens[b]], device=raw.device)
            ids, lps, ranks = gather_logprobs(
                raw[torch.from_numpy(pick).to(raw.device)], emitted, max(ks_lp[b] for b in want)
            )
            ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
            i = 0
            for b in want:
                k = ks_lp[b] + 1
                logprobs[b] = [(ids[j][:k], lps[j][:k], ranks[j]) for j in range(i, i + len(tokens[b]))]
                i += len(tokens[b])
        return tokens, logprobs

    def propose(self, batch: InputBatch, rows: list[int], inputs: ModelInputs) -> list[list[int]]:
        """Drafts for the next step of each sampled row (in `rows` order; [] where none). A step
        of only decodes and verifications (every request sampled, none with more new tokens than
        a verification) is timed into the policy's cost model first, then the proposal."""
        n = inputs.num_scheduled_tokens
        if rows and len(rows) == len(inputs.req_ids) and int(n.max()) <= 1 + self.config.num_speculative_tokens:
            self.policy.cost.observe_step(int(n.sum()), time.perf_counter() - self.step_start)
        k = self.policy.num_spec_tokens(len(rows))
        ks = [k if k > 0 and speculates(batch.states[r].sampling_params) else 0 for r in rows]
        if self.paged is not None:  # its cache follows every step, drafts or not (a cost of its own)
            self.paged.catch_up(batch, inputs, rows)
        start = time.perf_counter()
        drafts = self.proposer.propose(batch, rows, ks)
        self.policy.cost.observe_proposal(sum(map(len, drafts)), time.perf_counter() - start)
        return drafts


def expanded_metadata(states, drafts: list[list[int]], eos_ids, vocab_size: int, device) -> Optional[SamplingMetadata]:
    """SamplingMetadata of the k + 1 positions of each row: position j sees drafts 0..j-1 as
    output (penalties, min_tokens); None when every row is plain greedy."""
    if all(s.sampling_params.plain_greedy for s in states):
        return None
    params, prompts, outputs, stops = [], [], [], []
    for s, d in zip(states, drafts):
        p = s.sampling_params
        stop = set(p.all_stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        out = s.token_ids[s.num_prompt_tokens :]
        for j in range(len(d) + 1):
            params.append(p)
            prompts.append(s.token_ids[: s.num_prompt_tokens])
            outputs.append(out + list(d[:j]))
            stops.append(stop)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        generators=[None] * len(params),
        stop_ids_for_min_tokens=stops,
        vocab_size=vocab_size,
        device=device,
    )
