"""/score, /v1/rerank (/rerank, /v2/rerank) and /pooling through httpx against a real `pagedllm
serve --task embed` of the tiny random model: every score is the cosine of transformers' pooled
vectors (last token, normalised) of the two texts, within 1e-4; rerank sorts by it in Jina's and
Cohere's shape with top_n and return_documents; bad fields are 400s naming them."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from server_utils import TINY, RemoteServer, assert_error
from test_embeddings import reference  # noqa: F401  (a fixture)

QUERY = "w5 w17 w33"
DOCS = ["w5 w17 w34", "w250 w9 w64 w3 w4 w5 w6 w7 w8", "w33 w17 w5", "w100 w101"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        ["--model", TINY, "--task", "embed", "--max-model-len", "64", "--kv-cache-memory", "0.01", "--block-size", "4"]
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def cos(reference):  # noqa: F811
    pooled, tok = reference

    def f(a: str, b: str) -> float:
        return float(F.cosine_similarity(pooled(tok(a)["input_ids"]), pooled(tok(b)["input_ids"]), dim=0))

    return f


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_score_pairings(server, cos):
    one_to_many = post(server, "/score", {"model": TINY, "text_1": QUERY, "text_2": DOCS})
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCS)))
    for d, doc in zip(one_to_many["data"], DOCS):
        assert d["object"] == "score" and d["score"] == pytest.approx(cos(QUERY, doc), abs=1e-4)
    pairwise = post(server, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})["data"]
    assert [d["score"] for d in pairwise] == pytest.approx([cos(DOCS[0], DOCS[2]), cos(DOCS[1], DOCS[3])], abs=1e-4)
    single = post(server, "/score", {"text_1": QUERY, "text_2": QUERY})
    assert single["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert single["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank(server, cos, path):
    want = sorted(range(len(DOCS)), key=lambda i: -cos(QUERY, DOCS[i]))
    # Jina's shape: documents as strings, every one back with its text.
    r = post(server, path, {"model": TINY, "query": QUERY, "documents": DOCS})
    assert [x["index"] for x in r["results"]] == want
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(cos(QUERY, DOCS[x["index"]]), abs=1e-4)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert r["usage"]["total_tokens"] > 0
    # Cohere's: documents as {"text"} objects, top_n, no documents returned.
    r = post(
        server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False}
    )
    assert [x["index"] for x in r["results"]] == want[:2] and all("document" not in x for x in r["results"])
    assert len(post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 99})["results"]) == len(DOCS)


def test_pooling(server, reference):  # noqa: F811
    pooled, tok = reference
    r = post(server, "/pooling", {"input": DOCS[:2]})
    for d, text in zip(r["data"], DOCS[:2]):
        assert d["object"] == "pooling"
        assert torch.allclose(torch.tensor(d["data"]), pooled(tok(text)["input_ids"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "a", "documents": [3]}, "documents"),
        ("/v1/rerank", {"documents": ["b"]}, "query"),
        ("/pooling", {"input": []}, "input"),
        ("/classify", {"input": "a"}, "model"),  # a decoder has no classification head
    ],
)
def test_bad_input(server, path, body, field):
    err = assert_error(httpx.post(server.url + path, json=body), 400)
    assert err["param"] is not None and err["param"].startswith(field), err


def test_generating_server_refuses(tiny_shared_server):
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        assert_error(httpx.post(tiny_shared_server.url + path, json=body), 400, "wrong_runner")
