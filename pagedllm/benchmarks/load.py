"""The load generator of `pagedllm bench serve` (and of `bench serve --against`): streamed
/v1/completions requests of random token-id prompts with ignore_eos, sent as fast as a
concurrency allows or at a Poisson rate; per request the time to first token (TTFT), the time
per output token after it (TPOT), the gaps between streamed chunks (ITL) and end to end (E2E),
summarised per run."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0
    start: float = 0.0  # perf_counter when sent


async def _one(session, url: str, headers: dict, body: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(body["prompt"]))
    t0 = res.start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as r:
            res.status = r.status
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return res
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if chunk.get("choices") and (
                    chunk["choices"][0].get("text") or chunk["choices"][0].get("finish_reason")
                ):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_len > 0
        if not res.ok:
            res.error = "no usage / no tokens"
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures, it does not stop
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(
    base_url: str, headers: dict, bodies: list[dict], concurrency: int, rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    """aiohttp rather than httpx: a streamed request costs the client about a fifth of the CPU
    (3 against 16 ms for 33 events), and the client shares the machine with the servers it measures."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600.0)) as session:

        async def limited(body):
            async with sem:
                return await _one(session, url, headers, body)

        t0 = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1000 if len(xs) else float("nan")


def summarize(results: list[RequestResult], duration: float, concurrency: int, long_len: int = 0) -> dict:
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if r.status == 503]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    out_toks = sum(r.output_len for r in ok)
    in_toks = sum(r.prompt_len for r in ok)
    row = {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok) - len(rejected),
        "rejected": len(rejected),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_toks / duration,
        "total_token_throughput": (in_toks + out_toks) / duration,
        "input_tokens": in_toks,
        "output_tokens": out_toks,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        row[f"mean_{name}_ms"] = float(np.mean(xs)) * 1000 if xs else float("nan")
        for q in (50, 90, 99):
            row[f"p{q}_{name}_ms"] = _pct(xs, q)
    if long_len:  # mixed workload: the short requests' time between tokens
        row["p99_short_itl_ms"] = _pct([x for r in ok if r.prompt_len < long_len for x in r.itl], 99)
        row["p50_short_itl_ms"] = _pct([x for r in ok if r.prompt_len < long_len for x in r.itl], 50)
    if rejected and ok:  # early rejection: admitted requests per 10 s window of sending
        t0 = min(r.start for r in results)
        bins = np.bincount([int((r.start - t0) // 10) for r in ok])
        row["admitted_per_10s"] = bins.tolist()
    errors = sorted({r.error for r in results if not r.ok and r.status != 503})
    if errors:
        row["errors"] = errors[:5]
    return row


def model_name(base_url: str, headers: dict) -> str:
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def request_bodies(tok, ns: argparse.Namespace, model: str, seed: int) -> list[dict]:
    """The run's streamed /v1/completions bodies: random prompts of `seed` (ns's lengths)."""
    from pagedllm.benchmarks.common import random_requests

    def span(n):
        return max(1, int(n * (1 - ns.random_range_ratio))), max(1, int(n * (1 + ns.random_range_ratio)))

    reqs = random_requests(tok, ns.num_prompts, span(ns.random_input_len), span(ns.random_output_len), seed)
    if ns.long_every > 0:  # mixed: every K-th prompt long
        longs = random_requests(
            tok, ns.num_prompts // ns.long_every + 1, span(ns.long_input_len), span(ns.random_output_len), seed + 10_000
        )
        for j in range(ns.long_every - 1, len(reqs), ns.long_every):
            reqs[j] = longs[j // ns.long_every]
    return [
        {
            "model": model,
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in reqs
    ]


def measure(ns: argparse.Namespace, base_url: str, headers: dict, bodies: list[dict], concurrency: int) -> dict:
    """ns.warmup short requests, then `bodies` at `concurrency` -> the run's summary row."""
    warm = [{**bodies[0], "prompt": bodies[0]["prompt"][-8:][::-1], "max_tokens": 4}] * ns.warmup
    if warm:
        asyncio.run(_run(base_url, headers, warm, concurrency, math.inf, ns.seed))
    results, duration = asyncio.run(_run(base_url, headers, bodies, concurrency, ns.request_rate, ns.seed))
    return summarize(results, duration, concurrency, ns.long_input_len if ns.long_every > 0 else 0)


def print_run(row: dict) -> None:
    print(
        f"concurrency {row['concurrency']}: {row['completed']} done, {row['failed']} failed, {row['rejected']} "
        f"rejected (503) in {row['duration_s']:.1f} s",
        flush=True,
    )
    for key in ("p50_short_itl_ms", "p99_short_itl_ms", "admitted_per_10s"):
        if key in row:
            print(f"  {key}: {row[key]}")
    for e in row.get("errors", []):
        print(f"  error: {e}")
