"""Small online estimators the proxy's predictions are made of. The windowed ones forget what is
older than `max_age` seconds: when everything is refused no new observation comes, and a window
of stale bad ones must not refuse everything for good."""

from __future__ import annotations

from collections import deque

import numpy as np

MAX_AGE_S = 30.0


class Ewma:
    def __init__(self, value: float, alpha: float = 0.2) -> None:
        self.value, self.alpha = value, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


class _Window:
    """The last `maxlen` observations of the last `max_age` seconds, as (time, value...)."""

    def __init__(self, maxlen: int, max_age: float) -> None:
        self.obs: deque[tuple] = deque()
        self.maxlen, self.max_age = maxlen, max_age
        self._stale = True

    @property
    def n(self) -> int:
        return len(self.obs)

    def _add(self, item: tuple) -> None:
        self.obs.append(item)
        self._stale = True
        if len(self.obs) > self.maxlen:
            self._drop(self.obs.popleft())

    def _drop(self, item: tuple) -> None:
        """An observation left the window."""

    def expire(self, t: float) -> None:
        while self.obs and self.obs[0][0] < t - self.max_age:
            self._drop(self.obs.popleft())
            self._stale = True


class LinearFit(_Window):
    """y = a + b * x by least squares over a window (running sums: O(1) per observation), b >= 0
    (a cost does not fall with load: a negative slope is noise, the mean is used), never below
    the least y in the window. Fewer than 4 observations, or all at one x: their mean; none:
    `default`."""

    def __init__(self, maxlen: int, default: float = 0.0, max_age: float = MAX_AGE_S) -> None:
        super().__init__(maxlen, max_age)
        self.default = default
        self._sums = np.zeros(4)  # x, y, x * x, x * y
        self._coef = (default, 0.0, default)  # (a, b, least y)

    def add(self, t: float, x: float, y: float) -> None:
        self._sums += (x, y, x * x, x * y)
        self._add((t, x, y))

    def _drop(self, item: tuple) -> None:
        _, x, y = item
        self._sums -= (x, y, x * x, x * y)
        if not self.obs:
            self._sums[:] = 0.0  # no rounding left over

    def _fit(self) -> tuple[float, float, float]:
        if self._stale:
            self._stale = False
            n = len(self.obs)
            if n == 0:
                self._coef = (self.default, 0.0, self.default)
            else:
                sx, sy, sxx, sxy = self._sums
                a, b = sy / n, 0.0
                var = sxx - sx * sx / n
                if n >= 4 and var > 1e-9 * max(sxx, 1.0):  # not all at one x
                    slope = (sxy - sx * sy / n) / var
                    if slope > 0:
                        a, b = (sy - slope * sx) / n, slope
                self._coef = (float(a), float(b), min(y for _, _, y in self.obs))
        return self._coef

    def coef(self) -> tuple[float, float]:
        a, b, _ = self._fit()
        return a, b

    def __call__(self, x: float) -> float:
        a, b, least = self._fit()
        return max(a + b * x, least)


def isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent
    violators: a run that falls is replaced by its weighted mean)."""
    blocks: list[list[float]] = []  # [mean, weight, count of values]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


class TailMargin(_Window):
    """What the predictions missed by, recently, by the decode load a request was admitted at: the
    `quantile` of (measured - predicted) over a window of admitted requests, in bins of
    `bin_width` loads (adjacent bins pooled, from the highest load down, until each group holds
    `min_count` requests), made non-decreasing in the load (isotonic: a tail does not shrink as
    the batch grows; it smooths the groups' noise). Added to the prediction before the SLO check,
    so that the SLO holds for the tail (the goal is the admitted requests' p99), not for
    the mean. By load because the tail is not one size: at 2x
    overload on the 2-core machine the decode side's first-token p99 was 1.2 s at 40-80 streams
    and 2.2-2.6 s at 100-140 (BENCHMARKS.md), so one margin for all refused too much at low load
    and too little at high load.

    `at(t, load)` -> (base, extra): `base` the tail at the lowest loads seen (0 below `min_count`
    requests or when they were over-predicted), `extra` how much more it is at `load`'s group (the
    highest group's beyond it)."""

    def __init__(
        self,
        quantile: float = 0.99,
        maxlen: int = 2048,
        min_count: int = 32,
        max_age: float = MAX_AGE_S,
        bin_width: int = 16,
    ) -> None:
        super().__init__(maxlen, max_age)
        self.quantile, self.min_count, self.bin_width = quantile, min_count, bin_width
        self._base = 0.0
        self._bins = np.zeros(0, np.int64)  # each group's lowest bin, ascending
        self._extra = np.zeros(0)  # each group's tail above `_base`, non-decreasing
        # The window's errors and loads beside `obs` (oldest first, dropped with it): read into
        # arrays without a generator, the refit runs once per first token in the proxy's loop.
        self._errors: deque[float] = deque()
        self._loads: deque[int] = deque()

    def add(self, t: float, measured: float, predicted: float, load: int = 0) -> None:
        self._errors.append(measured - predicted)
        self._loads.append(load)
        self._add((t,))

    def _drop(self, item: tuple) -> None:
        self._errors.popleft()
        self._loads.popleft()

    def _refit(self) -> None:
        n = len(self.obs)
        self._base, self._bins, self._extra = 0.0, np.zeros(0, np.int64), np.zeros(0)
        if n < self.min_count:
            return
        bins = np.fromiter(self._loads, np.int64, n) // self.bin_width
        errors = np.fromiter(self._errors, np.float64, n)
        order = np.lexsort((errors, bins))  # by bin, then error
        errors = errors[order]
        uniq, start = np.unique(bins[order], return_index=True)
        # Groups of adjacent bins of min_count requests or more, closed from the top down (the
        # sparse high loads pool together rather than borrow a lower load's tail); what is left
        # at the bottom joins the lowest group. -> indices into uniq where each group starts.
        firsts, acc, ends = [], 0, start.tolist()[1:] + [n]
        for i in range(len(uniq) - 1, -1, -1):
            acc += ends[i] - int(start[i])
            if acc >= self.min_count:
                firsts.append(i)
                acc = 0
        firsts = firsts[::-1]
        firsts[0] = 0
        lo, size = start[firsts], np.diff(np.append(start[firsts], n))
        # Each group's quantile, numpy's linear interpolation, over its sorted errors at once.
        pos = self.quantile * (size - 1)
        below = np.floor(pos).astype(np.int64)
        above = np.minimum(below + 1, size - 1)
        tails = errors[lo + below] + (pos - below) * (errors[lo + above] - errors[lo + below])
        tails = np.maximum(isotonic(tails, size.astype(np.float64)), 0.0)
        self._base, self._bins, self._extra = float(tails[0]), uniq[firsts], tails - tails[0]

    def at(self, t: float, load: int = 0) -> tuple[float, float]:
        self.expire(t)
        if self._stale:
            self._stale = False
            self._refit()
        if not len(self._bins):
            return self._base, 0.0
        i = int(np.searchsorted(self._bins, load // self.bin_width, side="right")) - 1
        return self._base, float(self._extra[i]) if i >= 0 else 0.0
