"""AsyncEncoderEngine (engine/async_encoder.py): prompts of concurrent requests run together in
one padded forward, cut by the padded-token budget, and each vector equals sentence-transformers'
encode of its text alone (so padding beside longer prompts changes nothing)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import encoder_dirs
from pagedllm.engine.async_encoder import AsyncEncoderEngine

TEXTS = [
    "hi",
    "Paged attention stores the KV cache in blocks.",
    "The quick brown fox jumps over the lazy dog.",
    "A longer sentence, with commas and numbers like 3.14, that the tokenizer splits into word pieces.",
    "short one",
    "encoders read the whole prompt at once",
]


@pytest.fixture(scope="module")
def st_vectors():
    return encoder_dirs.st_encoder()(TEXTS)


@pytest.mark.parametrize("budget,forwards", [(8192, 1), (40, None)])
def test_concurrent_requests_share_forwards(st_vectors, budget, forwards):
    async def main():
        engine = AsyncEncoderEngine(encoder_dirs.minilm_dir(), max_num_batched_tokens=budget)
        await engine.start()
        ids = [engine.processor.tokenize(t)[1] for t in TEXTS]
        try:  # one request per text, all queued before the batch loop runs
            out = await asyncio.gather(*(engine.embed([p]) for p in ids))
        finally:
            await engine.shutdown()
        return engine.num_forwards, torch.tensor([o[0] for o in out]), ids

    num_forwards, got, ids = asyncio.run(main())
    if forwards is not None:
        assert num_forwards == forwards
    else:  # 40 padded tokens: sorted by length, each forward as full as the budget lets it be
        lens = sorted(map(len, ids))
        assert 1 < num_forwards < len(TEXTS) and max(lens) <= 40
    torch.testing.assert_close(got, st_vectors, atol=1e-5, rtol=1e-5)


def test_cancelled_request_is_skipped(st_vectors):
    async def main():
        engine = AsyncEncoderEngine(encoder_dirs.minilm_dir())
        await engine.start()
        ids = [engine.processor.tokenize(t)[1] for t in TEXTS[:2]]
        try:
            gone = asyncio.ensure_future(engine.embed([ids[0]]))
            await asyncio.sleep(0)  # queued, then its client leaves
            gone.cancel()
            kept = await engine.embed([ids[1]])
        finally:
            await engine.shutdown()
        return engine.num_rows, kept

    num_rows, kept = asyncio.run(main())
    assert num_rows == 1  # the cancelled prompt never ran
    torch.testing.assert_close(torch.tensor(kept[0]), st_vectors[1], atol=1e-5, rtol=1e-5)


def test_overload_and_shutdown_refuse():
    async def main():
        engine = AsyncEncoderEngine(encoder_dirs.minilm_dir(), max_waiting_requests=2)
        await engine.start()
        ids = engine.processor.tokenize("hi")[1]
        try:  # the third request finds two prompts waiting: refused before it is queued
            results = await asyncio.gather(*(engine.embed([ids]) for _ in range(3)), return_exceptions=True)
            waiting = asyncio.ensure_future(engine.embed([ids]))
            await asyncio.sleep(0)
            engine.stop_accepting()  # shutdown: a waiting prompt and any new request get EngineDeadError
            stopped = await asyncio.gather(waiting, engine.embed([ids]), return_exceptions=True)
        finally:
            await engine.shutdown()
        return results, stopped

    results, stopped = asyncio.run(main())
    assert [type(r).__name__ for r in results] == ["list", "list", "EngineOverloadedError"]
    assert [type(r).__name__ for r in stopped] == ["EngineDeadError", "EngineDeadError"]


def test_bfloat16(st_vectors):
    async def main():
        engine = AsyncEncoderEngine(encoder_dirs.minilm_dir(), dtype="bfloat16")
        await engine.start()
        try:
            return await engine.embed([engine.processor.tokenize(t)[1] for t in TEXTS])
        finally:
            await engine.shutdown()

    got = torch.tensor(asyncio.run(main()))
    cos = torch.nn.functional.cosine_similarity(got, st_vectors, dim=-1)
    assert cos.min() > 0.99 and (got - st_vectors).abs().max() > 1e-5  # close, and not float32's numbers
