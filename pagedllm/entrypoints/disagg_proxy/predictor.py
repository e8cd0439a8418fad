"""What the proxy predicts, from rates it measures (Mooncake's conductor).

A prefill instance is a queue: admitting a request of u uncached prompt tokens books u / rate
seconds after the work already booked (`busy_until`). The uncached part comes from a prefix match
against the prompts this instance has seen (chained hashes of fixed-size text chunks, the text
stand-in for the engine's block hashes). A decode instance is a batch queue (decode_queue.py):
the request's first token there comes after the transfer, a wait for a slot and the steps of a
batch as large as the streams it holds plus those admitted to it and still prefilling. The
predicted TTFT is the sum: prefill queue + prefill + the decode side's first-token delay.
Admission is decided on these predictions (booked work and predicted load), never on a count of
requests in flight, so a steady overload is admitted at a steady rate instead of flapping
between all and none; the recent tail of the prediction errors at the decode load the request
would join is added before the SLO check (`TailMargin`) so that the SLO holds for the admitted
requests' p99, not their mean.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from pagedllm.entrypoints.disagg_proxy.decode_queue import DecodeInstance, FirstTokenForecast
from pagedllm.entrypoints.disagg_proxy.fit import Ewma, TailMargin

CHUNK_CHARS = 64  # text per prefix hash (about a KV block of English text)
MAX_PREFIXES = 100_000  # hashes remembered per prefill instance (LRU)
RATE_DECAY = 0.8  # weight of the past in the measured prefill rate, per answer


def chunk_hashes(text: str) -> list[int]:
    out, parent = [], None
    for i in range(len(text) // CHUNK_CHARS):
        parent = hash((parent, text[i * CHUNK_CHARS : (i + 1) * CHUNK_CHARS]))
        out.append(parent)
    return out


class PrefillInstance:
    def __init__(self, url: str) -> None:
        self.url = url
        self.busy_until = 0.0
        # Decayed sums of uncached prompt tokens and of the busy seconds they took: the rate is
        # their ratio (robust to a batch of prefills answering at once), 2000 tokens/s until measured.
        self._tokens, self._busy = 2000.0 * 0.05, 0.05
        self.last_finish = 0.0
        self.chars_per_token = Ewma(4.0)
        self.prefixes: OrderedDict[int, None] = OrderedDict()
        self.in_flight = 0

    @property
    def rate(self) -> float:
        """Uncached prompt tokens per second."""
        return self._tokens / self._busy

    def uncached_chars(self, hashes: list[int], text_len: int) -> int:
        hit = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            hit += 1
        return text_len - hit * CHUNK_CHARS

    def predict(self, hashes: list[int], text_len: int, now: float) -> tuple[float, float]:
        """(seconds of queue ahead, seconds of this prefill)."""
        tokens = self.uncached_chars(hashes, text_len) / max(self.chars_per_token.value, 0.5)
        return max(self.busy_until - now, 0.0), tokens / max(self.rate, 1.0)

    def book(self, seconds: float, now: float) -> None:
        self.busy_until = max(self.busy_until, now) + seconds
        self.in_flight += 1

    def done(
        self,
        hashes: list[int],
        booked: float,
        start: float,
        finish: Optional[float],
        uncached_tokens: int = 0,
        prompt_tokens: int = 0,
        text_len: int = 0,
    ) -> None:
        """A prefill booked at `start` answered at `finish` (None: it failed). Its busy time is
        from when the instance was last seen free (its previous answer) or `start`, whichever
        is later, so that waiting in the queue is not counted as work; the booked queue is
        corrected by what it really took, both ways (a rate believed too high must not leave the
        queue underestimated, nor one believed too low refuse everything)."""
        self.in_flight -= 1
        if finish is None:
            self.busy_until -= booked
            return
        busy = max(finish - max(start, self.last_finish), 0.0)
        self.last_finish = max(self.last_finish, finish)
        self.busy_until = finish if self.in_flight == 0 else max(finish, self.busy_until + busy - booked)
        if uncached_tokens > 0:
            self._tokens = RATE_DECAY * self._tokens + uncached_tokens
            self._busy = RATE_DECAY * self._busy + busy
        if prompt_tokens > 0:
            self.chars_per_token.update(text_len / prompt_tokens)
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > MAX_PREFIXES:
            self.prefixes.popitem(last=False)


def now() -> float:
    return time.monotonic()


def pick_decode(instances: list[DecodeInstance], t: float) -> tuple[DecodeInstance, FirstTokenForecast]:
    """The one whose first token comes soonest for a new stream (then the lowest predicted time
    between tokens), -> (instance, that first-token forecast)."""
    best: Optional[tuple] = None
    for d in instances:
        f = d.forecast(d.load() + 1, t)
        key = (f.total, d.tbt(d.load() + 1, t))
        if best is None or key < best[0]:
            best = (key, d, f)
    return best[1], best[2]


def pick_prefill(
    instances: list[PrefillInstance], hashes: list[int], text_len: int, t: float
) -> tuple[PrefillInstance, float, float]:
    """-> (instance, its queue seconds, this prefill's seconds) of the lowest predicted TTFT."""
    best: Optional[tuple] = None
    for inst in instances:
        queue, prefill = inst.predict(hashes, text_len, t)
        if best is None or queue + prefill < best[1] + best[2]:
            best = (inst, queue, prefill)
    return best


@dataclass
class Admission:
    """Where a request would go and what it is predicted to see there."""

    prefill: PrefillInstance
    decode: DecodeInstance
    queue: float  # seconds of prefill work booked ahead of it
    seconds: float  # seconds of its own prefill
    first: FirstTokenForecast  # the decode side's part of the TTFT
    ttft: float
    tbt: float
    margin: float = 0.0  # what recent predictions missed by at the lowest load (TailMargin.at)
    load_margin: float = 0.0  # and how much more at the load this request joins
    load: int = 1  # that load: the decode instance's streams + pending, itself included
    idle: bool = False  # nothing booked on its prefill instance, nothing on its decode instance

    def misses(self, ttft_slo: Optional[float], tbt_slo: Optional[float], limited: bool = True) -> bool:
        """`ttft_slo`: the target the admission holds (the SLO, or SloFeedback's lower target).
        The base margin counts for at most half of it: where the noise alone is larger, holding
        the tail would mean refusing nearly everything (the feedback corrects the rest, slowly).
        What the tail grows by with the load counts whole: it refuses only the loads it was
        measured at, never everything.
        An idle pair of instances admits whatever is predicted: the request is served as fast as
        this system can serve one, and its measurement is what corrects a prediction learned
        under a load that has drained (a fit that had gone flat at 0.63 s a first token refused
        everything for 25 s at 2x overload, the instances idle, until its window expired).
        With a TTFT SLO, a `limited` request (a streamed one: only those have a first token the
        limit learns from, and a TTFT for the SLO to hold) that would take the decode instance's
        load above its LoadLimit is refused whatever the prediction (load_limit.py)."""
        if self.idle:
            return False
        if ttft_slo is not None and limited and not self.decode.limit.allows(self.load):
            return True
        margin = min(self.margin, ttft_slo / 2) + self.load_margin if ttft_slo is not None else 0.0
        return (ttft_slo is not None and self.ttft + margin > ttft_slo) or (tbt_slo is not None and self.tbt > tbt_slo)


def plan(
    prefills: list[PrefillInstance],
    decodes: list[DecodeInstance],
    hashes: list[int],
    text_len: int,
    t: float,
    margin: Optional[TailMargin] = None,
) -> Admission:
    """The prefill instance of the lowest predicted TTFT and the decode instance of the soonest
    first token; TTFT = prefill queue + prefill + the decode side's first-token delay; the recent
    tail of the errors at the load the request would join there (`margin`)."""
    prefill, queue, seconds = pick_prefill(prefills, hashes, text_len, t)
    decode, first = pick_decode(decodes, t)
    load = decode.load() + 1
    base, extra = margin.at(t, load) if margin is not None else (0.0, 0.0)
    return Admission(
        prefill,
        decode,
        queue,
        seconds,
        first,
        queue + seconds + first.total,
        decode.tbt(load, t),
        base,
        extra,
        load,
        idle=load == 1 and queue <= 0.0,
    )
