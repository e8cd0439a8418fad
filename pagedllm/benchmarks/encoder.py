"""`pagedllm bench encoder`: texts embedded per second by an encoder model served as the server
serves it (AsyncEncoderEngine), with --num-requests single-text requests all in flight at once,
batched across requests (up to --max-num-seqs prompts a batch) against one request at a time
(max_num_seqs 1); sentence-transformers' encode of the same texts in one call as the baseline.
Rounds interleaved (--repeat); the median of each, and the largest difference of the served
vectors from sentence-transformers' (a check that the figures are of the right work).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="an encoder model (default all-MiniLM-L6-v2)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64, help="most prompts in one batch (default 64)")
    p.add_argument(
        "--words",
        type=int,
        nargs=2,
        default=(8, 48),
        metavar=("MIN", "MAX"),
        help="each text's length in words, drawn uniformly (default 8 48)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def random_texts(n: int, words: tuple[int, int], seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = (
        "the a model server cache block token batch query document score vector text paged attention "
        "encoder request fast small large memory kernel layer head rank search answer".split()
    )
    return [" ".join(rng.choice(vocab, rng.integers(words[0], words[1] + 1))) for _ in range(n)]


async def _timed(engine, ids: list[list[int]]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = await asyncio.gather(*(engine.embed([p]) for p in ids))
    return time.perf_counter() - start, np.asarray([o[0] for o in out])  # [N, H]


async def _run(args, texts: list[str]) -> tuple[dict[str, list[float]], float]:
    from pagedllm.engine.async_encoder import AsyncEncoderEngine
    from pagedllm.models.download import resolve_model

    path = str(resolve_model(args.model))
    engines = {
        "batched": AsyncEncoderEngine(path, max_num_seqs=args.max_num_seqs),
        "one at a time": AsyncEncoderEngine(path, max_num_seqs=1),
    }
    for e in engines.values():
        await e.start()
    ids = [engines["batched"].processor.tokenize(t)[1] for t in texts]
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    seconds: dict[str, list[float]] = {name: [] for name in (*engines, "sentence-transformers encode")}
    max_diff = 0.0
    try:
        for name, e in engines.items():  # warm-up
            await _timed(e, ids[:8])
        for _ in range(args.repeat):
            start = time.perf_counter()
            want = st.encode(texts, batch_size=args.max_num_seqs, convert_to_numpy=True)  # [N, H]
            seconds["sentence-transformers encode"].append(time.perf_counter() - start)
            for name, e in engines.items():
                s, got = await _timed(e, ids)
                seconds[name].append(s)
                max_diff = max(max_diff, float(np.abs(got - want).max()))
    finally:
        for e in engines.values():
            await e.shutdown()
    return seconds, max_diff


def main(args: argparse.Namespace) -> int:
    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    texts = random_texts(args.num_requests, tuple(args.words), args.seed)
    seconds, max_diff = asyncio.run(_run(args, texts))
    rows = [
        {"name": name, "s": statistics.median(s), "rate": len(texts) / statistics.median(s)}
        for name, s in seconds.items()
    ]
    one = next(r for r in rows if r["name"] == "one at a time")["s"]
    for r in rows:
        r["vs"] = one / r["s"]
    print_table(
        rows,
        [("name", "run", ""), ("s", "seconds", ".3f"), ("rate", "texts/s", ".1f"), ("vs", "x one at a time", ".2f")],
    )
    print(f"largest difference from sentence-transformers' vectors: {max_diff:.2e}")
    if args.output_json:
        write_json(
            args.output_json,
            {"machine": machine, "command": command_line(), "rows": rows, "seconds": seconds, "max_diff": max_diff},
        )
    return 0
