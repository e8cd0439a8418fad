"""Pooler (`--runner pooling`): a prompt's final hidden states (after the final norm) -> one
vector, its last token's or the mean over all its tokens, L2-normalised when configured.

A prompt may run over several steps (chunked prefill): the last token is in the final chunk;
the mean keeps a running sum per request across chunks, restarted when a request starts from
its first token again (new, or resumed by recompute after a preemption). Mean pooling needs
every prompt token computed by the request itself, so its engine has prefix caching off
(EngineArgs)."""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.config import PoolerConfig


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self.sums: dict[str, torch.Tensor] = {}  # mean: req_id -> [hidden] float32 sum so far

    def forget(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self.sums.pop(r, None)

    def __call__(self, hidden: torch.Tensor, inputs, states, num_computed: np.ndarray) -> list[Optional[list[float]]]:
        """hidden [num_tokens, H] of this step; inputs: the step's prepared inputs (rows in
        batch order); states: each row's CachedRequestState; num_computed: each row's computed
        tokens before this step. -> per row, the pooled vector when its prompt ends this step."""
        rows = inputs.sample_rows.tolist()
        out: list[Optional[list[float]]] = [None] * len(inputs.req_ids)
        if self.config.pooling_type == "LAST":
            if not rows:
                return out
            pooled = hidden[inputs.logits_indices.to(hidden.device)].float()  # [len(rows), H]
        else:
            counts = torch.from_numpy(inputs.num_scheduled_tokens.astype(np.int64)).to(hidden.device)
            owner = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), counts)  # [T]
            seg = torch.zeros(len(counts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            seg.index_add_(0, owner, hidden[: owner.shape[0]].float())  # [num_reqs, H]
            done = set(rows)
            for row, state in enumerate(states):
                total = seg[row] if num_computed[row] == 0 else self.sums.pop(state.req_id) + seg[row]
                if row not in done:
                    self.sums[state.req_id] = total
                else:
                    seg[row] = total / state.num_prompt_tokens
            if not rows:
                return out
            pooled = seg[torch.as_tensor(rows, device=hidden.device)]
        if self.config.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        for row, vec in zip(rows, pooled.cpu().tolist()):
            out[row] = vec
        return out
