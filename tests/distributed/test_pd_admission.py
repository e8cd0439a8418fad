"""The proxy's admission (predictor.py) on a synthetic arrival stream, in simulated time: one
prefill instance that really serves FIFO at 1000 tokens/s (the predictor starts believing 2000
and must learn it), Poisson arrivals at 2x its capacity, a TTFT SLO. Once loaded, the admitted
count per 10 s window stays within +-20 % of its mean (no oscillation between all and none), the
admitted rate is the capacity, and admitted requests meet the SLO. (A predictor that counted
the time waiting in the queue as prefill time learned a rate far too low here and then refused
every request for good.)"""

from __future__ import annotations

import heapq
import random

from pagedllm.entrypoints.disagg_proxy.predictor import CHUNK_CHARS, DecodeInstance, PrefillInstance, chunk_hashes, plan

RATE = 1000.0  # tokens/s the instance really prefills
CHARS = 2000  # per prompt: 500 tokens at 4 characters each -> 0.5 s, capacity 2/s
SLO = 2.0
ARRIVALS_PER_S = 4.0  # 2x capacity
DURATION, WARMUP, WINDOW = 200.0, 30.0, 10.0


def _simulate(seed: int = 0):
    rng = random.Random(seed)
    prefill, decode = PrefillInstance("p"), DecodeInstance("d")
    server_free, done_q = 0.0, []  # the real instance: FIFO
    t, i, admitted = 0.0, 0, []  # admitted: (arrival, ttft)
    while t < DURATION:
        t += rng.expovariate(ARRIVALS_PER_S)
        while done_q and done_q[0][0] <= t:  # answers that came back before this arrival
            finish, _, arrival, hashes, a = heapq.heappop(done_q)
            tokens = CHARS // 4
            prefill.done(hashes, a.seconds, arrival, finish, tokens, tokens, CHARS)
        text = f"{i:08d}" + "x" * (CHARS - 8)  # unique: no prefix hits
        hashes = chunk_hashes(text)
        a = plan([prefill], [decode], hashes, len(text), t)
        i += 1
        if a.misses(SLO, None):
            continue
        prefill.book(a.seconds, t)
        finish = server_free = max(server_free, t) + (CHARS / 4) / RATE
        heapq.heappush(done_q, (finish, i, t, hashes, a))
        admitted.append((t, finish - t))
    return admitted


def test_admission_steady_under_2x_overload():
    admitted = _simulate()
    loaded = [(t, ttft) for t, ttft in admitted if t >= WARMUP]
    counts = [sum(1 for t, _ in loaded if w <= t < w + WINDOW) for w in range(int(WARMUP), int(DURATION), int(WINDOW))]
    mean = sum(counts) / len(counts)
    assert 0.9 * 2.0 * WINDOW <= mean <= 1.1 * 2.0 * WINDOW, counts  # the capacity, 2/s
    assert all(abs(c - mean) <= 0.2 * mean for c in counts), counts
    assert max(ttft for _, ttft in loaded) <= SLO * 1.05, max(ttft for _, ttft in loaded)


def test_chunk_hashes_prefix_match():
    shared = "a" * (3 * CHUNK_CHARS)
    p = PrefillInstance("p")
    p.done(chunk_hashes(shared + "b" * CHUNK_CHARS), 0.0, 0.0, 1.0)
    other = shared + "c" * (2 * CHUNK_CHARS)
    assert p.uncached_chars(chunk_hashes(other), len(other)) == 2 * CHUNK_CHARS
