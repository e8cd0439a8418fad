"""The most streams a decode instance is admitted to hold, moved by what the admitted requests
measured: a concurrency limit by additive increase and multiplicative decrease, with a slow start
(TCP's congestion window, on TTFT instead of losses).

Why beside the predictions: at 2x overload on the 2-core machine the TTFT tail came in bursts at
high decode load (docs/history/benchmarks.md, 2026-11-24): the cores saturated, every process's event loop
fell behind (the decode server took up to 2 s to read a new request), and the requests admitted
meanwhile all missed; the first-token fit and the tail margin learn such a load only after its
requests come back, and forget it 30 s after admission stops going there, so the bursts came
back, and a cold proxy admitted 190 streams in its first seconds. The limit remembers the load
where misses began until requests near it come back well within the target, and a cold proxy
reaches a high load only step by step: doubling from `start` up to `ssthresh` (half the decode
instance's slots: a doubling from 64 to 128 had let 46 requests miss in the 2 s before their
misses came back), then + `increase` at a time.

Decisions count only requests admitted since the previous one (admitted before it, under another
limit, they would answer twice for one overshoot). `misses` of them over `high` x the target: the
limit falls at once to `decrease` x the mean load those were admitted at, or x itself if lower
(as TCP halves the data in flight, not the window: a limit far above the load that missed, left
there by a slow start, would otherwise fall to where it still never binds), not below `floor`,
and the slow start ends. `count` of them admitted at `near` x the limit or more (those that tell
about it), all within `low` x the target: it rises (slow start: x 2, up to `ssthresh`; then
+ `increase`); else it holds (the dead band: without it the limit crept up between the bursts of
misses and the next burst met it there). Admission refuses a request that would take the
instance's load above it.
"""

from __future__ import annotations


class LoadLimit:
    def __init__(
        self,
        start: int = 16,
        ssthresh: int = 64,
        count: int = 32,
        misses: int = 2,
        near: float = 0.75,
        high: float = 0.9,
        low: float = 0.7,
        decrease: float = 0.8,
        increase: float = 4.0,
        floor: int = 4,
    ) -> None:
        self.limit, self.ssthresh = float(start), float(ssthresh)
        self.slow_start = start < ssthresh
        self.count, self.misses, self.near, self.high, self.low = count, misses, near, high, low
        self.decrease, self.increase, self.floor = decrease, increase, floor
        self._since = float("-inf")  # requests admitted from then on count for the next decision
        self._missed: list[int] = []  # loads of those over high x the target
        self._n = 0  # of those near the limit
        self._worst = 0.0  # their longest TTFT

    def allows(self, load: int) -> bool:
        """`load`: the instance's streams + pending, the request itself included."""
        return load <= self.limit

    def add(self, t: float, admitted_at: float, load: int, ttft: float, target: float) -> None:
        """A request admitted at `admitted_at` as the `load`-th stream saw its first token at `t`,
        `ttft` seconds after it arrived; `target`: the TTFT the admission holds."""
        if admitted_at < self._since:
            return
        if ttft > self.high * target:
            self._missed.append(load)
            if len(self._missed) >= self.misses:
                at = sum(self._missed) / len(self._missed)
                self.limit = max(self.decrease * min(self.limit, at), float(self.floor))
                self.slow_start = False
                self._decided(t)
                return
        if load < self.near * self.limit:
            return
        self._n += 1
        self._worst = max(self._worst, ttft)
        if self._n >= self.count:
            if self._worst <= self.low * target:
                if self.slow_start:
                    self.limit = min(self.limit * 2, self.ssthresh)
                    self.slow_start = self.limit < self.ssthresh
                else:
                    self.limit += self.increase
            self._decided(t)

    def _decided(self, t: float) -> None:
        self._since, self._missed, self._n, self._worst = t, [], 0, 0.0
