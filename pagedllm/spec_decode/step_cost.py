"""StepCost: the measured cost of a decode / verification step by its number of tokens, for the
adaptive speculation length (length_policy.py).

What a draft costs depends on the machine and the path a step takes: on the CPU a step of up
to 8 rows runs the C++ decode loop, which reads each weight once for all rows (a verification of
k + 1 tokens costs about a one-token step where reading weights dominates, k + 1 times one where
arithmetic does, as on a 2-core AVX2 CPU), and more rows take the eager layers. So the runner
times each step of only decodes and verifications (forward, sampling, rejection), an EMA per
number of tokens n, and the proposer's time per drafted token; `relative(B, k)` is then
(T(B (k + 1)) + B k P) / T(B). Until T(B) and T(B (k + 1)) are both measured, a prior (a draft
token costs `prior` of a plain step) stands in; the prior is optimistic so that an unmeasured
length is tried, measured, and dropped if it does not pay.
"""

from __future__ import annotations


class StepCost:
    def __init__(self, prior: float = 0.12, ema: float = 0.2) -> None:
        self.prior, self.ema = prior, ema
        self.seconds: dict[int, float] = {}  # EMA of a step's time, by its number of tokens
        self.propose_per_token = 0.0  # EMA of the proposer's time per drafted token

    def _avg(self, old, new: float) -> float:
        return new if old is None else old + self.ema * (new - old)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.seconds[num_tokens] = self._avg(self.seconds.get(num_tokens), seconds)

    def observe_proposal(self, num_drafts: int, seconds: float) -> None:
        if num_drafts:
            self.propose_per_token = self._avg(self.propose_per_token or None, seconds / num_drafts)

    def relative(self, batch_size: int, k: int) -> float:
        """The cost of a step verifying k drafts for each of batch_size rows, over a plain step's."""
        plain, verify = self.seconds.get(batch_size), self.seconds.get(batch_size * (k + 1))
        if plain is None or verify is None:
            return 1 + self.prior * batch_size * k
        return (verify + batch_size * k * self.propose_per_token) / plain
