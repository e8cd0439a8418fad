"""DraftDirProposer: a draft model loaded from an HF directory ("draft_model" with a path), with
the target's vocabulary, in the same process and on the same device, with its own paged KV cache
(PagedDraftProposer: its layers' tensors beside the target's, through the same block table).

catch_up runs it over every position the target made final this step and the just-sampled
token, so it has no prefill of its own to schedule; its output at the last token gives draft 1,
then k - 1 one-token steps. Any architecture the engine loads, one KV cache group (the engine
refuses a sliding/full hybrid draft, engine/compat.py).
"""

from __future__ import annotations

import torch

from pagedllm.spec_decode.paged_draft import PagedDraftProposer


def load_draft_model(engine_config, path: str):
    """The draft's model, with the target's dtype, device, attention backend and max_model_len."""
    from pagedllm.models.loader import load_model
    from pagedllm.models.model_config_loader import model_config_from_dir

    mc, dc = engine_config.model_config, engine_config.device_config
    draft = model_config_from_dir(path, dtype=mc.dtype, max_model_len=mc.max_model_len, seed=mc.seed)
    return load_model(draft, None, dc.device, dc.attention_backend)


class DraftDirProposer(PagedDraftProposer):
    lag = 1

    def _step(self, prev_hidden, ids, pos) -> torch.Tensor:
        return self.model(ids, pos)
