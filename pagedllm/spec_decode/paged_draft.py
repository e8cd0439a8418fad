"""PagedDraftProposer: a proposer with a model of its own and a paged KV cache of its own (the MTP
module, a draft model from an HF directory), kept in the target's blocks through the same block
table: the runner allocates its layers' tensors beside the target's (one page per block holds
both), so allocation, swap, copy-on-write and prefix caching move it with the target's.

Each step has two parts (as vLLM's EAGLE / draft proposers):
- catch_up: after the target's forward, the draft runs over every row's positions this step
  made final: from the step's first position to num_computed_tokens after the rollback (no
  rejected draft), and for a draft that reads the token at its position (`lag` 1) also the
  just-sampled token. Its cache then holds, at every computed position, the entry of the true
  tokens: what it wrote there from drafts last step is overwritten before any query reads it.
- propose: k steps from each sampling row's last caught-up output; step j (j >= 1) feeds
  draft j at position num_tokens - lag + j (inside the row's blocks: the scheduler's
  num_lookahead_tokens slots; a row with too few drafts fewer).

Drafts are the draft distribution's argmax (q one-hot for the rejection sampler, as the
"self:N" draft). A subclass says what its model takes (`_step`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.attention.layer import bind_kv_cache, get_kv_cache_spec
from pagedllm.forward_context import set_forward_context


def span_offsets(lens: np.ndarray) -> np.ndarray:
    """[T] each token's index within its span of lens[i] tokens (0, 1, .., lens[i] - 1, 0, ..)."""
    return np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)


def span_metadata(attn_backend, batch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, block_size: int):
    """Attention metadata for lens[i] tokens from position starts[i] of persistent row rows[i]
    (a chunk over the row's cached past, through its block table) -> (metadata, positions [T])."""
    bs = block_size
    pos = np.repeat(starts, lens) + span_offsets(lens)  # [T]
    slot = batch.block_table_np[np.repeat(rows, lens), pos // bs].astype(np.int64) * bs + pos % bs  # [T]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # [R + 1]
    seq_lens = (starts + lens).astype(np.int32)  # [R]
    meta = attn_backend.build_metadata(
        torch.from_numpy(qsl),
        torch.from_numpy(seq_lens),
        torch.from_numpy(batch.block_table_np[rows]),
        torch.from_numpy(slot),
        bs,
        int(lens.max()),
        int(seq_lens.max()),
    )
    return meta, pos.astype(np.int64)


def draft_lengths(batch, rows: np.ndarray, ks, lag: int, block_size: int, max_model_len: int) -> np.ndarray:
    """ks cut so that a draft step writes only inside the row's blocks (positions up to
    num_tokens - lag + k - 1) and the drafts stay below max_model_len -> [R] >= 0."""
    num_tokens = batch.num_tokens[rows].astype(np.int64)
    capacity = batch.num_blocks_per_row[rows].astype(np.int64) * block_size
    ks = np.minimum(np.asarray(ks, dtype=np.int64), capacity - num_tokens + lag)
    return np.minimum(ks, max_model_len - num_tokens - 1).clip(min=0)


class PagedDraftProposer:
    lag = 1  # draft j's input sits at position num_tokens - lag + j
    needs_target_hidden = False  # True: catch_up reads the target's hidden states of the step

    def __init__(self, model, attn_backend, block_size: int, max_model_len: int) -> None:
        self.model, self.attn_backend = model, attn_backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.device = next(model.parameters()).device
        self.last: dict[int, torch.Tensor] = {}  # sampling row -> its last caught-up output [H]

    # ------------------------------------------------------------ its cache
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list:
        """Its layers' specs, appended to the target's (the runner allocates them together)."""
        return list(get_kv_cache_spec(self.model, block_size, dtype).values())

    def bind_kv_cache(self, kv_caches: list) -> None:
        bind_kv_cache(self.model, kv_caches)

    # ------------------------------------------------------------ what a subclass gives
    def _step(self, prev_hidden: Optional[torch.Tensor], ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """prev [T, H] (the target's hidden states in catch_up, the last step's output after;
        None for a draft that takes none), ids [T], positions [T] -> outputs [T, H]."""
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """outputs [N, H] -> draft logits [N, V]."""
        return self.model.compute_logits(hidden)

    def _catch_up_hidden(self, target_index: np.ndarray) -> Optional[torch.Tensor]:
        """What _step takes as prev_hidden for the target's step tokens target_index [T]."""
        return None

    # ------------------------------------------------------------ the two parts
    def _run(self, batch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, prev, ids: np.ndarray):
        meta, pos = span_metadata(self.attn_backend, batch, rows, starts, lens, self.block_size)
        with set_forward_context(meta):
            return self._step(
                prev, torch.from_numpy(ids.astype(np.int64)).to(self.device), torch.from_numpy(pos).to(self.device)
            )

    def catch_up(self, batch, inputs, sample_rows: list[int]) -> None:
        """The draft over each scheduled row's positions made final this step (module docstring)."""
        self.last = {}
        R = len(inputs.req_ids)
        rows = np.arange(R)
        starts = inputs.num_computed_tokens.numpy().astype(np.int64)  # [R] before the step
        ends = batch.num_computed_tokens_cpu[:R].astype(np.int64)  # after the rollback
        sampled = np.zeros(R, dtype=bool)
        sampled[sample_rows] = True
        ends = np.where(sampled, batch.num_tokens[:R] - self.lag + 1, ends)
        capacity = batch.num_blocks_per_row[:R].astype(np.int64) * self.block_size
        lens = np.minimum(ends, capacity) - starts  # [R]
        live = np.flatnonzero(lens > 0)
        if not len(live):
            return
        rows, starts, lens = rows[live], starts[live], lens[live]
        qsl = inputs.query_start_loc.numpy()
        offsets = span_offsets(lens)  # [T]
        pos = np.repeat(starts, lens) + offsets
        ids = batch.token_ids_np[np.repeat(rows, lens), pos + self.lag - 1]  # [T]
        prev = self._catch_up_hidden(np.repeat(qsl[rows], lens) + offsets)
        out = self._run(batch, rows, starts, lens, prev, ids)  # [T, H]
        last = np.cumsum(lens) - 1
        for r, i, end in zip(rows.tolist(), last.tolist(), (starts + lens).tolist()):
            if sampled[r] and end == batch.num_tokens[r] - self.lag + 1:  # caught up to its last token
                self.last[r] = out[i]

    def propose(self, batch, rows: list[int], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts after row rows[i]'s last token (fewer where its blocks end)."""
        drafts: list[list[int]] = [[] for _ in rows]
        rows_np = np.array(rows, dtype=np.int64)
        ks_np = draft_lengths(batch, rows_np, ks, self.lag, self.block_size, self.max_model_len)
        live = np.array([i for i in np.flatnonzero(ks_np > 0).tolist() if rows[i] in self.last], dtype=np.int64)
        if not len(live):
            return drafts
        hidden = torch.stack([self.last[rows[i]] for i in live.tolist()])  # [L, H]
        ids = self._logits(hidden).argmax(dim=-1).cpu().numpy()  # [L]
        for j in range(1, int(ks_np[live].max()) + 1):
            for i, t in zip(live.tolist(), ids.tolist()):
                drafts[i].append(t)
            keep = ks_np[live] > j
            if not keep.any():
                break
            live, ids, hidden = live[keep], ids[keep], hidden[torch.from_numpy(keep).to(hidden.device)]
            brows = rows_np[live]
            pos = batch.num_tokens[brows].astype(np.int64) - self.lag + j
            hidden = self._run(batch, brows, pos, np.ones(len(live), dtype=np.int64), hidden, ids)
            ids = self._logits(hidden).argmax(dim=-1).cpu().numpy()
        return drafts
