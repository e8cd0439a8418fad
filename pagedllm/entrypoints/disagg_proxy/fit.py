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
        self._sums = np.zeros(4)                 # x, y, x * x, x * y
        self._coef = (default, 0.0, default)     # (a, b, least y)

    def add(self, t: float, x: float, y: float) -> None:
        self._sums += (x, y, x * x, x * y)
        self._add((t, x, y))

    def _drop(self, item: tuple) -> None:
        _, x, y = item
        self._sums -= (x, y, x * x, x * y)
        if not self.obs:
            self._sums[:] = 0.0   # no rounding left over

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
                if n >= 4 and var > 1e-9 * max(sxx, 1.0):   # not all at one x
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


class TailMargin(_Window):
    """What the predictions missed by, recently: the `quantile` of (measured - predicted) over a
    window of admitted requests; 0 below `min_count` of them or when they were over-predicted.
    Added to the prediction before the SLO check, so that the SLO holds for the tail (the issue's
    goal is the admitted requests' p99), not for the mean."""

    def __init__(self, quantile: float = 0.99, maxlen: int = 512, min_count: int = 32,
                 max_age: float = MAX_AGE_S) -> None:
        super().__init__(maxlen, max_age)
        self.quantile, self.min_count = quantile, min_count
        self._value = 0.0

    def add(self, t: float, measured: float, predicted: float) -> None:
        self._add((t, measured - predicted))

    def at(self, t: float) -> float:
        self.expire(t)
        if self._stale:
            self._stale = False
            errors = np.fromiter((e for _, e in self.obs), np.float64, len(self.obs))
            self._value = (max(float(np.quantile(errors, self.quantile)), 0.0)
                           if len(errors) >= self.min_count else 0.0)
        return self._value
