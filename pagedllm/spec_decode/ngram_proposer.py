"""NgramProposer: prompt lookup decoding. The last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up earlier in the request's own tokens; the tokens that followed
the first earlier occurrence are the draft (as vLLM's). No model, no distribution (the
rejection sampler takes q one-hot)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """tokens [T] (prompt + output so far) -> up to k draft tokens ([] when no n-gram recurs)."""
        T = len(tokens)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:T - 1], n)              # [T - n, n], not the suffix itself
            hits = np.flatnonzero((windows == tokens[T - n:]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start:start + k].tolist()
        return []

    def propose(self, batch, rows: list[int], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for the persistent batch's row rows[i] (one request at a time, each
        a vectorised search over its tokens)."""
        return [self.propose_one(batch.token_ids_np[r, :batch.num_tokens[r]], k) if k > 0 else []
                for r, k in zip(rows, ks)]
