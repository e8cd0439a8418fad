"""MTPProposer: DeepSeek-V3's next-n module (models/deepseek_mtp.py) drafts k tokens (vLLM's
DeepSeekMTP with the EAGLE proposer).

The module at position i takes the target's last-layer hidden state h_i (before the final norm:
kept by a forward hook on the target's final norm, whose fused add returns the residual stream
as its second output) and the embedding of t_{i+1}, and predicts t_{i+2}. catch_up runs it over
every position the target made final this step, with the next token of each (the prompt's, an
accepted draft, or the sampled one), so its own paged latent cache (PagedDraftProposer) holds the
true entry at every computed position; its output at num_tokens - 2 gives draft 1. For k > 1 the
first module is applied again (vLLM's recursion: its own output hidden state and the last draft
at the next position). A checkpoint with several next-n modules: only the first drafts (its
cache is the only one kept in step; DeepSeek-V3 ships one).

A prefix-cache hit reuses the module's entries of the cached blocks; the last entry of such a
block was computed with the token that followed it in the request that wrote it, which may not
be this request's: only its drafts (never its output) can differ.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.spec_decode.paged_draft import PagedDraftProposer


class MTPProposer(PagedDraftProposer):
    lag = 2
    needs_target_hidden = True

    def __init__(self, mtp, target, attn_backend, block_size: int, max_model_len: int) -> None:
        super().__init__(mtp, attn_backend, block_size, max_model_len)
        self.stream = None  # [T, H]: the target's last forward, before its final norm
        target.norm.register_forward_hook(self._keep_stream)

    def _keep_stream(self, module, args, output) -> None:
        if isinstance(output, tuple):  # norm(x, residual) -> (normed, x + residual)
            self.stream = output[1]

    def _catch_up_hidden(self, target_index: np.ndarray) -> torch.Tensor:
        return self.stream[torch.from_numpy(target_index).to(self.stream.device)]

    def _step(self, prev_hidden, ids, pos) -> torch.Tensor:
        return self.model(prev_hidden, ids, pos)
