"""NgramProposer: prompt lookup decoding. The longest suffix of the request's tokens (up to
prompt_lookup_max, at least prompt_lookup_min) that occurred earlier in its own tokens (prompt
and output) is found; the tokens that followed its most recent earlier occurrence are the draft.
No model, no distribution (the rejection sampler takes q one-hot).

Why longest, most recent, and a draft as long as the match is strong (measured on the copy
prompts of `bench spec-decode`, BENCHMARKS.md): the first occurrence of the longest of 4..1-grams
drafted 4 tokens on any 1-gram hit ("the", a newline), mostly from the chat template, and 62 % of
those drafts were rejected. A longer match pins the position in the text being copied (a
repeated line is told apart by what came before it), the most recent occurrence follows the
copy where the text repeats itself, and a draft of 2 (n - 1) tokens (1 for a 1-gram) speculates
far only where the match says the output is copying.
"""

from __future__ import annotations

import numpy as np


def draft_length(match_len: int, k: int) -> int:
    return min(k, max(1, 2 * (match_len - 1)))


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def longest_match(self, tokens: np.ndarray) -> tuple[int, int]:
        """tokens [T] -> (n, e): the longest suffix length n <= max_n that also ends at an earlier
        position e < T - 1 (the most recent such e); (0, -1) when none."""
        T = len(tokens)
        ends = np.flatnonzero(tokens[: T - 1] == tokens[T - 1])  # earlier ends of the 1-gram
        n = 1 if len(ends) else 0
        while len(ends) and n < min(self.max_n, T - 1):
            longer = ends[ends >= n]
            longer = longer[tokens[longer - n] == tokens[T - 1 - n]]  # the match extends one back
            if not len(longer):
                break
            ends, n = longer, n + 1
        return (n, int(ends[-1])) if n else (0, -1)

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """tokens [T] (prompt + output so far) -> up to k draft tokens ([] when no n-gram of at
        least prompt_lookup_min recurs)."""
        n, e = self.longest_match(tokens)
        if n < self.min_n:
            return []
        return tokens[e + 1 : e + 1 + draft_length(n, k)].tolist()

    def propose(self, batch, rows: list[int], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for the persistent batch's row rows[i] (one request at a time, each
        a vectorised search over its tokens)."""
        return [
            self.propose_one(batch.token_ids_np[r, : batch.num_tokens[r]], k) if k > 0 else [] for r, k in zip(rows, ks)
        ]
