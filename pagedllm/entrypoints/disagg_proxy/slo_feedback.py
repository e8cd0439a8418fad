"""A slow feedback correction on top of the predicted TTFT: the proxy admits against an internal
target `slo * factor` and moves `factor` by what the admitted requests really saw.

Each decision looks at the measured TTFTs of `count` requests admitted since the previous
decision (those admitted before it are dropped: they were admitted under the old target, and
counting them again would answer twice for one overshoot). Their `quantile` above `high` x the
SLO: the factor falls multiplicatively (x `decrease`); below `low` x the SLO: it rises additively
(+ `increase`); in between it holds (the dead band). It stays within [`floor`, 1]. `high` < 1:
the proxy measures the first token as it relays it, the client later (its own event loop, the
network), and the p99 of 64 requests is a noisy estimate; aiming a little under the SLO keeps the
client's p99 within it.

Why this cannot oscillate: under overload the admitted rate is the instances' completion rate
whatever the target (admission stops when the predicted queue reaches the target, and the queue
moves only as fast as it is served); the factor only sets how deep the queue is held. A step of
the factor lowers the target by at most (1 - decrease) x SLO and shifts admissions once (a
pause while the queue drains to the new depth: small steps keep it a small dent), and steps come at most once per `count`
measured requests, each decided on requests admitted under the current target only; the dead
band keeps it from stepping both ways around one operating point.
"""

from __future__ import annotations

import numpy as np


class SloFeedback:
    def __init__(
        self,
        slo: float,
        count: int = 64,
        quantile: float = 0.99,
        decrease: float = 0.85,
        increase: float = 0.02,
        high: float = 0.9,
        low: float = 0.7,
        floor: float = 0.3,
    ) -> None:
        self.slo, self.count, self.quantile = slo, count, quantile
        self.decrease, self.increase, self.high, self.low, self.floor = decrease, increase, high, low, floor
        self.factor = 1.0
        self._since = float("-inf")  # requests admitted from then on count for the next decision
        self._ttfts: list[float] = []

    @property
    def target(self) -> float:
        """The TTFT the admission holds the predictions to (seconds)."""
        return self.slo * self.factor

    def add(self, t: float, admitted_at: float, ttft: float) -> None:
        """A request admitted at `admitted_at` saw its first token at `t`, `ttft` seconds later."""
        if admitted_at < self._since:
            return
        self._ttfts.append(ttft)
        if len(self._ttfts) < self.count:
            return
        tail = float(np.quantile(self._ttfts, self.quantile))
        if tail > self.high * self.slo:
            self.factor = max(self.factor * self.decrease, self.floor)
        elif tail < self.low * self.slo:
            self.factor = min(self.factor + self.increase, 1.0)
        self._since, self._ttfts = t, []
