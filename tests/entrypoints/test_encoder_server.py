"""`pagedllm serve all-MiniLM-L6-v2` (the ready model's name, and its directory): an encoder
model served by AsyncEncoderEngine, through the official `openai` client against a real server.
Every vector equals sentence-transformers' encode of the same text (normalised, as its
Normalize module does) within 1e-5, alone, in one request and across concurrent requests;
more than max_seq_length (256) tokens is a 400; generation endpoints are 400s naming what the
model serves."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

import encoder_dirs
from pagedllm.models.download import MINILM_MODEL
from server_utils import RemoteServer, assert_error

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in blocks.",
    "hi",
    "A longer sentence, with commas and numbers like 3.14 and 42, split into several word pieces.",
]
CONCURRENT = [f"request number {i}: " + "word " * (i % 7) for i in range(12)]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([MINILM_MODEL])
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def st_encode():
    encode = encoder_dirs.st_encoder()
    return lambda texts: encode(texts).double().numpy()


def close(got, want):
    got = np.asarray(got, dtype=np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert np.all(cos >= 0.99999), cos


def test_embeddings_equal_sentence_transformers(server, st_encode):
    client = server.client()
    want = st_encode(TEXTS)
    out = client.embeddings.create(model=MINILM_MODEL, input=TEXTS)
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    close([d.embedding for d in out.data], want)
    one = client.embeddings.create(model=MINILM_MODEL, input=TEXTS[1])
    close([one.data[0].embedding], want[1:2])
    tok = minilm_tokenizer()
    ids = tok(TEXTS[0])["input_ids"]
    assert out.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    by_ids = client.embeddings.create(model=MINILM_MODEL, input=[ids])  # token ids as the input
    close([by_ids.data[0].embedding], want[0:1])
    # the client asks for base64 (little-endian float32) by itself and decodes it; floats when asked
    raw = httpx.post(
        server.base_url + "/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}, timeout=60
    ).json()["data"][0]["embedding"]
    close([np.frombuffer(base64.b64decode(raw), dtype="<f4")], want[2:3])
    floats = client.embeddings.create(model=MINILM_MODEL, input=TEXTS[2], encoding_format="float")
    close([floats.data[0].embedding], want[2:3])


def minilm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(encoder_dirs.minilm_dir())


def test_concurrent_requests(server, st_encode):
    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(client.embeddings.create(model=MINILM_MODEL, input=t) for t in CONCURRENT))

    outs = asyncio.run(main())
    close([o.data[0].embedding for o in outs], st_encode(CONCURRENT))


def test_dimensions_and_score(server, st_encode):
    client = server.client()
    want = st_encode(TEXTS[:2])
    out = client.embeddings.create(model=MINILM_MODEL, input=TEXTS[:2], dimensions=32)
    cut = want[:, :32] / np.linalg.norm(want[:, :32], axis=-1, keepdims=True)
    close([d.embedding for d in out.data], cut)
    r = httpx.post(server.url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1]}, timeout=60).json()
    assert r["data"][0]["score"] == pytest.approx(float(want[0] @ want[1]), abs=1e-5)


def test_too_many_tokens_is_400(server):
    client = server.client()
    long_text = " ".join(f"word{i}" for i in range(200))  # > 256 word pieces
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM_MODEL, input=long_text)
    assert "maximum context length is 256 tokens" in e.value.message and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MINILM_MODEL, input=[[101] * 257])
    client.embeddings.create(model=MINILM_MODEL, input=[[101] * 256])  # exactly the limit is fine
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM_MODEL, input=[[30522]])
    assert "[0, 30522)" in e.value.message


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/classify", {"input": "hi"}),
    ],
)
def test_unserved_endpoints_are_400(server, path, body):
    r = httpx.post(server.url + path, json={"model": MINILM_MODEL, **body}, timeout=60)
    assert_error(r, 400, "unsupported_endpoint")
    message = r.json()["error"]["message"]
    assert path in message and "/v1/embeddings" in message and "BertModel" in message
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MINILM_MODEL, messages=[{"role": "user", "content": "hi"}])


def test_serve_by_directory(st_encode):
    path = encoder_dirs.minilm_dir()
    srv = RemoteServer([path])
    try:
        out = srv.client().embeddings.create(model=path, input=TEXTS[0])
        close([out.data[0].embedding], st_encode(TEXTS[:1]))
        assert [m.id for m in srv.client().models.list().data] == [path]
    finally:
        srv.close()
