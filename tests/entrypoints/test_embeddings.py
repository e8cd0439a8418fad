"""/v1/embeddings through the official openai client against a real `pagedllm serve --task embed`
(the alias of --runner pooling) of the tiny random model: the vectors equal transformers' last
hidden state (after the final norm) at the last token, normalised, within 1e-4, for every input
form and both encodings, and cut to `dimensions` and normalised again; usage counts the prompt
tokens; generation endpoints answer 400."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from server_utils import TINY, RemoteServer, assert_error

TEXTS = ["w5 w17 w33 w101 w7", "w250 w9 w64 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19"]


@pytest.fixture(scope="module")
def server():
    # A budget of 8 tokens: the longer prompts are prefilled in chunks, batched with the others.
    srv = RemoteServer(
        [
            "--model",
            TINY,
            "--task",
            "embed",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            "0.01",
            "--max-num-batched-tokens",
            "8",
            "--block-size",
            "4",
        ]
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference():
    """token ids -> transformers' pooled (last token, normalised) vector."""
    from transformers import AutoModel, AutoTokenizer
    from pagedllm.models.random_model import random_model_dir

    d = str(random_model_dir(TINY))
    model, tok = AutoModel.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d)

    def pooled(ids):
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)

    return pooled, tok


def as_tensor(vec) -> torch.Tensor:
    """A string where base64 was asked for explicitly (OpenAI's little-endian float32)."""
    return torch.tensor(np.frombuffer(base64.b64decode(vec), dtype="<f4").copy() if isinstance(vec, str) else vec)


def check(resp, ids_list, pooled):
    assert resp.object == "list" and [d.index for d in resp.data] == list(range(len(ids_list)))
    for d, ids in zip(resp.data, ids_list):
        got = as_tensor(d.embedding)
        assert got.shape == (128,)
        assert torch.allclose(got, pooled(ids), atol=1e-4, rtol=0), (got - pooled(ids)).abs().max()
    n = sum(len(ids) for ids in ids_list)
    assert resp.usage.prompt_tokens == n and resp.usage.total_tokens == n


def test_every_input_form(client, reference):
    pooled, tok = reference
    ids = [tok(t)["input_ids"] for t in TEXTS]
    # The client asks for base64 unless told otherwise; it decodes the vectors itself.
    check(client.embeddings.create(model=TINY, input=TEXTS[0]), ids[:1], pooled)
    check(client.embeddings.create(model=TINY, input=TEXTS, encoding_format="float"), ids, pooled)
    check(client.embeddings.create(model=TINY, input=ids[1]), ids[1:], pooled)
    many = [ids[0], ids[1], ids[0][:3], ids[1][2:]]
    r = client.embeddings.create(model=TINY, input=many, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in r.data)
    check(r, many, pooled)


def test_dimensions(client, reference):
    """The first n values of transformers' vector, L2-normalised again (the model's are)."""
    pooled, tok = reference
    ids = [tok(t)["input_ids"] for t in TEXTS]
    for fmt in ("float", "base64"):
        r = client.embeddings.create(model=TINY, input=TEXTS, dimensions=16, encoding_format=fmt)
        for d, i in zip(r.data, ids):
            got = as_tensor(d.embedding)
            assert got.shape == (16,)
            assert torch.allclose(got, F.normalize(pooled(i)[:16], dim=-1), atol=1e-4, rtol=0)
    full = client.embeddings.create(model=TINY, input=TEXTS[0], dimensions=128).data[0].embedding
    assert torch.allclose(torch.tensor(full), pooled(ids[0]), atol=1e-4, rtol=0)


def test_refusals(server, client):
    for bad in (0, 129, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=TINY, input=TEXTS[0], dimensions=bad)
        assert e.value.body["param"] == "dimensions" and "[1, 128]" in e.value.body["message"]
    for bad in ([], [[]], "", [1, 10**6]):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=TINY, input=bad)
        assert e.value.body["param"] == "input", bad
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "w5", "encoding_format": "int8"})
    assert_error(r, 400)
    # A pooling server does not generate.
    for path, body in (
        ("/v1/completions", {"prompt": "w5", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
        ("/v1/responses", {"input": "w5"}),
    ):
        err = assert_error(httpx.post(server.url + path, json=body), 400, "wrong_runner")
        assert "--runner generate" in err["message"]


def test_generating_server_refuses_embeddings(tiny_shared_server):
    err = assert_error(httpx.post(tiny_shared_server.url + "/v1/embeddings", json={"input": "w5"}), 400, "wrong_runner")
    assert "--runner pooling" in err["message"]


def test_runner_flags():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve", "--task", "embed"])).runner == "pooling"
    assert engine_args_from(parse(["serve", "--runner", "pooling"])).runner == "pooling"
    assert engine_args_from(parse(["serve"])).runner == "generate"
    with pytest.raises(ValueError, match="disagree"):
        engine_args_from(parse(["serve", "--runner", "generate", "--task", "embed"]))
