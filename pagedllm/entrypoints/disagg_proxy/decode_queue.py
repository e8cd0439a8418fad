"""The proxy's queueing model of a decode instance.

Its load is the streams the proxy has sent it and not seen end, plus the requests admitted to it
that are still prefilling (`pending`: they arrive soon, and counting them is what keeps a burst
of admissions from all seeing the same empty instance). A request arriving as the L-th stream
waits for its KV, then for a slot when L > max_num_seqs (streams leave at max_num_seqs per
stream duration), then for the steps of a batch of L streams. The first-token delay is fitted as
a + b * L over recent requests (least squares: `a` the transfer and fixed costs, `b` the measured
cost per stream); the time between tokens as a + b * streams over recent gaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.disagg_proxy.fit import Ewma, LinearFit
from pagedllm.entrypoints.disagg_proxy.load_limit import LoadLimit

DEFAULT_MAX_NUM_SEQS = 128  # the engine's default --max-num-seqs


@dataclass
class FirstTokenForecast:
    """Seconds from the decode request to its first token, by cause."""

    transfer: float  # the fit's intercept: KV pull and fixed costs
    slot_wait: float  # waiting for one of max_num_seqs slots
    step: float  # the steps of a batch of this many streams (per-stream cost * load)

    @property
    def total(self) -> float:
        return self.transfer + self.slot_wait + self.step


class DecodeInstance:
    def __init__(self, url: str, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> None:
        self.url = url
        self.max_num_seqs = max_num_seqs
        self.streams = 0  # sent to it, not ended
        self.pending = 0  # admitted to it, still prefilling
        self.gaps = LinearFit(512)  # (streams, seconds between tokens)
        self.first = LinearFit(256, default=0.01)  # (load at send, seconds to the first token)
        self.duration = Ewma(1.0)  # seconds a stream holds its slot (first token to end)
        # The most streams + pending it is admitted (with a TTFT SLO); slow start to half its slots.
        self.limit = LoadLimit(ssthresh=max(max_num_seqs // 2, 1))

    def load(self) -> int:
        return self.streams + self.pending

    def tbt(self, streams: int, t: float) -> float:
        """Predicted seconds between tokens with `streams` running."""
        self.gaps.expire(t)
        return self.gaps(streams)

    def forecast(self, position: int, t: float) -> FirstTokenForecast:
        """The first-token delay of a request arriving as stream number `position` (its own
        included) at time `t`: the fit at the batch it runs in, plus the wait for a slot beyond
        max_num_seqs."""
        self.first.expire(t)
        batch = min(position, self.max_num_seqs)
        transfer = max(self.first.coef()[0], 0.0)
        step = max(self.first(batch) - transfer, 0.0)
        slot_wait = max(position - self.max_num_seqs, 0) * self.duration.value / self.max_num_seqs
        return FirstTokenForecast(transfer, slot_wait, step)

    # ------------------------------------------------------------ what the proxy sees
    def admit(self) -> None:
        self.pending += 1

    def cancel(self) -> None:
        """An admitted request that will not come (its prefill failed)."""
        self.pending -= 1

    def start(self) -> int:
        """Its decode request goes out: -> the stream's position (the load it joins, itself included)."""
        self.pending -= 1
        self.streams += 1
        return self.streams

    def first_token(self, t: float, position: int, seconds: float) -> None:
        if position <= self.max_num_seqs:  # beyond, the slot wait is modelled apart
            self.first.add(t, position, seconds)

    def gap(self, t: float, seconds: float) -> None:
        self.gaps.add(t, self.streams, seconds)

    def end(self, held: float | None = None) -> None:
        """A stream ended; `held`: seconds from its first token to its end, when known."""
        self.streams -= 1
        if held is not None:
            self.duration.update(held)
