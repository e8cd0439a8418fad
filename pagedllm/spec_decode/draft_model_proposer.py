"""DraftModelProposer for "self:N": the target's first N layers with the target's final norm and
LM head draft k tokens, one batched decode step per token.

The draft's paged KV cache is the target's cache of those N layers, through the same block
table: a draft layer is the target's layer on the same tokens, so every accepted position's K/V
is already there (no draft prefill, no second cache to keep in step). The draft writes K/V only
at positions from the request's last token on (num_computed_tokens after the rollback), which
the target computes, and so overwrites, before it reads them; and only inside the request's own
blocks (the scheduler allocates num_lookahead_tokens extra slots; a row with fewer drafts fewer
tokens), never a shared one (copy-on-write has run for the last token's block; prefix-cache
blocks are full and before it).

The draft proposes its argmax (a deterministic proposal: the rejection sampler takes q one-hot,
which keeps sampled requests exact; a sampled draft with its q would be accepted more often).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.forward_context import set_forward_context
from pagedllm.spec_decode.paged_draft import draft_lengths, span_metadata


class DraftModelProposer:
    def __init__(self, model, num_layers: int, attn_backend, block_size: int, max_model_len: int) -> None:
        if not hasattr(model, "stage_layers") or len(model.stage_layers) <= num_layers:
            raise ValueError(
                f"speculative_config.model 'self:{num_layers}' needs a Llama-family target "
                f"with more than {num_layers} layers"
            )
        self.model, self.num_layers = model, num_layers
        self.attn_backend, self.block_size, self.max_model_len = attn_backend, block_size, max_model_len

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target's forward cut after layer N -> final-normed hidden states [T, hidden]."""
        m = self.model
        x, residual = m.embed(input_ids), None
        for layer in m.stage_layers[: self.num_layers]:
            x, residual = layer(x, positions, m.rope, residual)
        return m.norm(x, residual)[0]

    def propose(self, batch, rows: list[int], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts after row rows[i]'s last token (fewer where its blocks end)."""
        rows_np = np.array(rows, dtype=np.int64)
        # Inputs at positions num_tokens - 1 .. num_tokens + k - 2, inside the row's blocks.
        ks_np = draft_lengths(batch, rows_np, ks, 1, self.block_size, self.max_model_len)
        drafts: list[list[int]] = [[] for _ in rows]
        live = np.flatnonzero(ks_np > 0)
        if not len(live):
            return drafts
        num_tokens = batch.num_tokens[rows_np].astype(np.int64)  # [R]
        ids = batch.token_ids_np[rows_np[live], num_tokens[live] - 1].astype(np.int64)  # [L]
        pos = num_tokens[live] - 1
        device = next(self.model.parameters()).device
        for j in range(int(ks_np.max())):
            keep = ks_np[live] > j
            live, ids, pos = live[keep], ids[keep], pos[keep]
            meta, _ = span_metadata(
                self.attn_backend, batch, rows_np[live], pos, np.ones(len(live), dtype=np.int64), self.block_size
            )
            with set_forward_context(meta):
                hidden = self._forward(torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device))
            ids = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()  # [n]
            for i, t in zip(live.tolist(), ids.tolist()):
                drafts[i].append(t)
            pos = pos + 1
        return drafts
