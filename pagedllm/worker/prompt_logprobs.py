"""Prompt logprobs (SamplingParams.prompt_logprobs = k): the logprob of every prompt token given
the tokens before it, with its rank and the top k, from the logits of the prefill's positions.

Position p of a prompt scores prompt token p + 1, so a prompt of P tokens has P - 1 scored
tokens (the first has none). Each step scores the positions it computes: a chunked prefill
sends one chunk per step. Only the rows that asked pay: the other rows keep the logits of
their last token alone (the sampler's). The logprobs are raw (log_softmax of the model's
logits, before temperature or penalties), as the sampler's are."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from pagedllm.worker.sampler import gather_logprobs

# Positions scored per LM-head call: bounds the [rows, vocab] float32 logits a long prefill
# chunk would make at once (1024 x 49152 x 4 bytes = 200 MB).
MAX_ROWS_PER_CALL = 1024

# req id -> (prompt index of the first token scored, [n][k+1] token ids, [n][k+1] logprobs,
# [n] ranks): the prompt token first in each row, then the top k.
PromptLogprobsChunk = tuple[int, list[list[int]], list[list[float]], list[int]]


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, inputs, batch
) -> Optional[dict[str, PromptLogprobsChunk]]:
    """This step's prompt logprobs for the rows that ask for them; None when none does.
    hidden: [num_tokens, hidden] final hidden states; inputs: the step's ModelInputs; batch:
    the InputBatch they were made from (before this step's sampled tokens are appended)."""
    num_reqs = len(inputs.req_ids)
    ks = [s.sampling_params.prompt_logprobs for s in batch.states[:num_reqs]]
    if all(k is None for k in ks):
        return None
    wants = np.array([k is not None for k in ks])  # [num_reqs]
    rows = inputs.request_indices  # [num_tokens]
    positions = inputs.positions.numpy()
    scored = np.nonzero(wants[rows] & (positions + 1 < batch.num_prompt_tokens[rows]))[0]  # [m]
    if len(scored) == 0:
        return None
    targets = torch.from_numpy(batch.token_ids_np.reshape(-1)[inputs.token_indices[scored] + 1].astype(np.int64))  # [m]
    max_k = max(k for k in ks if k is not None)
    ids, lps, ranks = [], [], []
    for start in range(0, len(scored), MAX_ROWS_PER_CALL):
        sl = slice(start, start + MAX_ROWS_PER_CALL)
        index = torch.from_numpy(scored[sl]).to(hidden.device)
        logits = compute_logits(hidden[index]).float()  # [m', V]
        i, lp, r = gather_logprobs(torch.log_softmax(logits, dim=-1), targets[sl].to(hidden.device), max_k)
        ids.append(i.cpu())
        lps.append(lp.cpu())
        ranks.append(r.cpu())
    ids, lps, ranks = torch.cat(ids), torch.cat(lps), torch.cat(ranks)  # [m, max_k+1] ...
    # Split the scored positions by row (they are grouped by row, in row order).
    out: dict[str, PromptLogprobsChunk] = {}
    scored_rows = rows[scored]
    bounds = np.searchsorted(scored_rows, np.arange(num_reqs + 1))
    for row in np.unique(scored_rows).tolist():
        a, b = int(bounds[row]), int(bounds[row + 1])
        k = ks[row] + 1
        out[inputs.req_ids[row]] = (
            int(positions[scored[a]]) + 1,
            ids[a:b, :k].tolist(),
            lps[a:b, :k].tolist(),
            ranks[a:b].tolist(),
        )
    return out
