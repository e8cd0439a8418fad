"""What the proxy predicts, from rates it measures (Mooncake's conductor).

A prefill instance is a queue: admitting a request of u uncached prompt tokens books u / rate
seconds after the work already booked (`busy_until`), so the predicted TTFT is the booked work
ahead, plus this prefill, plus the KV transfer, plus one decode step. The uncached part comes
from a prefix match against the prompts this instance has seen (chained hashes of fixed-size
text chunks, the text stand-in for the engine's block hashes). A decode instance's time
between tokens is fitted as a + b * streams over recent observations (least squares). Admission
is decided on these predictions (booked work), never on a count of requests in flight, so a
steady overload is admitted at a steady rate instead of flapping between all and none.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

CHUNK_CHARS = 64          # text per prefix hash (about a KV block of English text)
MAX_PREFIXES = 100_000    # hashes remembered per prefill instance (LRU)
RATE_DECAY = 0.8          # weight of the past in the measured prefill rate, per answer


def chunk_hashes(text: str) -> list[int]:
    out, parent = [], None
    for i in range(len(text) // CHUNK_CHARS):
        parent = hash((parent, text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS]))
        out.append(parent)
    return out


class Ewma:
    def __init__(self, value: float, alpha: float = 0.2) -> None:
        self.value, self.alpha = value, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


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

    def done(self, hashes: list[int], booked: float, start: float, finish: Optional[float],
             uncached_tokens: int = 0, prompt_tokens: int = 0, text_len: int = 0) -> None:
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


class DecodeInstance:
    def __init__(self, url: str) -> None:
        self.url = url
        self.streams = 0
        self.obs: deque[tuple[int, float]] = deque(maxlen=512)   # (streams, seconds between tokens)
        self.transfer = Ewma(0.01)         # seconds from decode request to its first token

    def tbt(self, streams: int) -> float:
        """Predicted seconds between tokens with `streams` running."""
        if len(self.obs) < 4:
            return self.obs[-1][1] if self.obs else 0.0
        n, t = np.array(self.obs, dtype=np.float64).T
        if np.ptp(n) == 0:
            return float(t.mean())
        b, a = np.polyfit(n, t, 1)
        return float(max(a + b * streams, t.min()))


def now() -> float:
    return time.monotonic()


def pick_decode(instances: list[DecodeInstance]) -> DecodeInstance:
    """The one with the lowest predicted time between tokens once this stream joins."""
    return min(instances, key=lambda d: (d.tbt(d.streams + 1), d.streams))


def pick_prefill(instances: list[PrefillInstance], hashes: list[int], text_len: int,
                 t: float) -> tuple[PrefillInstance, float, float]:
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
    queue: float        # seconds of prefill work booked ahead of it
    seconds: float      # seconds of its own prefill
    ttft: float
    tbt: float

    def misses(self, ttft_slo: Optional[float], tbt_slo: Optional[float]) -> bool:
        return (ttft_slo is not None and self.ttft > ttft_slo) or (tbt_slo is not None and self.tbt > tbt_slo)


def plan(prefills: list[PrefillInstance], decodes: list[DecodeInstance], hashes: list[int], text_len: int,
         t: float) -> Admission:
    """The prefill instance of the lowest predicted TTFT and the decode instance of the lowest
    predicted TBT; TTFT = queue + prefill + the decode side's measured first-token delay."""
    prefill, queue, seconds = pick_prefill(prefills, hashes, text_len, t)
    decode = pick_decode(decodes)
    return Admission(prefill, decode, queue, seconds, queue + seconds + decode.transfer.value,
                     decode.tbt(decode.streams + 1))
