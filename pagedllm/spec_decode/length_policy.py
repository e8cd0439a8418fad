"""How many tokens to speculate in a step: fixed (num_speculative_tokens, as vLLM) or adaptive.

Adaptive (after SmartSpec's goodput rule): with an acceptance rate a (an EMA of the measured
one, drafts assumed independent), k drafts yield E(k) = (1 - a^(k+1)) / (1 - a) tokens a step;
verifying them (and proposing them) costs `StepCost.relative(B, k)` plain steps at batch B, as
measured on this machine by the runner (spec_decode/step_cost.py; a prior until then). Take the k in
[0, num_speculative_tokens] that maximises E(k) / cost(k); 0 when no k beats a plain step by a
margin. A policy at 0 still proposes one draft every `probe_every` steps so that a workload
that starts to repeat is noticed.
"""

from __future__ import annotations

from pagedllm.spec_decode.step_cost import StepCost


class SpecLengthPolicy:
    def __init__(
        self,
        num_speculative_tokens: int,
        adaptive: bool,
        draft_token_cost: float = 0.12,
        margin: float = 1.1,
        ema: float = 0.1,
        probe_every: int = 16,
    ) -> None:
        self.k_max = num_speculative_tokens
        self.adaptive = adaptive
        self.cost = StepCost(prior=draft_token_cost)
        self.margin, self.ema, self.probe_every = margin, ema, probe_every
        self.acceptance = 0.5  # prior before any draft was verified
        self.steps_at_zero = 0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            rate = num_accepted / num_draft_tokens
            self.acceptance += self.ema * (rate - self.acceptance)

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def num_spec_tokens(self, batch_size: int) -> int:
        if not self.adaptive:
            return self.k_max
        best_k, best = 0, self.margin
        for k in range(1, self.k_max + 1):
            gain = self.expected_tokens(k) / self.cost.relative(batch_size, k)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero % self.probe_every == 0:
                return 1
        return best_k
