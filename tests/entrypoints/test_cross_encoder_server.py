"""Sequence-classification encoders served (`pagedllm serve DIR` of a tiny random-weight
BertForSequenceClassification saved by transformers): a one-label cross-encoder's /score,
/v1/rerank and /rerank equal sentence-transformers' CrossEncoder.predict (the sigmoid of the
logit of [CLS] query [SEP] document [SEP]); a three-label classifier's /classify (vLLM's shape)
equals the softmax of transformers' logits; bad requests are 400s naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from encoder_dirs import random_encoder
from server_utils import RemoteServer, assert_error

QUERY = "what is paged attention?"
DOCS = [
    "Paged attention stores the KV cache in fixed-size blocks.",
    "The quick brown fox jumps over the lazy dog.",
    "hi",
    "vLLM serves language models with continuous batching and paged attention.",
]


def _serve(tmp_path_factory, name: str, num_labels: int):
    path = tmp_path_factory.mktemp(name)
    model, tok = random_encoder(path, "BertForSequenceClassification", None, num_labels=num_labels, init_range=0.2)
    return RemoteServer([str(path), "--served-model-name", name]), path, model, tok


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    srv, path, model, tok = _serve(tmp_path_factory, "cross-encoder", 1)
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(path), device="cpu")
    yield srv, lambda pairs: ref.predict(pairs, convert_to_numpy=True).astype(np.float64), model, tok
    srv.close()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    srv, _, model, tok = _serve(tmp_path_factory, "classifier", 3)
    yield srv, model, tok
    srv.close()


def post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_score(cross):
    server, predict, _, _ = cross
    want = predict([(QUERY, d) for d in DOCS])
    assert np.diff(np.sort(want)).min() > 1e-3  # scores well apart: the rerank order is not float noise
    r = post(server, "/score", {"model": "cross-encoder", "text_1": QUERY, "text_2": DOCS})
    np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=1e-5)
    assert [d["index"] for d in r["data"]] == list(range(len(DOCS)))
    r = post(server, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})  # pairwise
    np.testing.assert_allclose([d["score"] for d in r["data"]], predict(list(zip(DOCS[:2], DOCS[2:]))), atol=1e-5)
    assert r["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank(cross, path):
    server, predict, _, _ = cross
    want = predict([(QUERY, d) for d in DOCS])
    order = list(np.argsort(-want))
    r = post(server, path, {"query": QUERY, "documents": DOCS})  # Jina's shape
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}
    r = post(
        server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False}
    )  # Cohere's
    assert [x["index"] for x in r["results"]] == order[:2] and all("document" not in x for x in r["results"])


def test_classify_one_label(cross):
    server, predict, _, _ = cross
    r = post(server, "/classify", {"input": [QUERY, DOCS[0]]})
    assert [d["num_classes"] for d in r["data"]] == [1, 1]
    assert r["data"][0]["label"] == "LABEL_0" and r["object"] == "list" and r["id"].startswith("classify-")
    # a single text is [CLS] text [SEP]: the sigmoid of its logit
    assert 0 < r["data"][0]["probs"][0] < 1


def test_classify(classifier):
    server, model, tok = classifier
    texts = [QUERY, *DOCS]
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt")
        want = torch.softmax(model(**enc).logits.double(), -1).numpy()  # [N, 3]
    for path in ("/classify", "/v1/classify"):
        r = post(server, path, {"model": "classifier", "input": texts})
        assert [d["index"] for d in r["data"]] == list(range(len(texts)))
        np.testing.assert_allclose([d["probs"] for d in r["data"]], want, atol=1e-5)
        assert [d["label"] for d in r["data"]] == [f"LABEL_{i}" for i in want.argmax(-1)]
        assert all(d["num_classes"] == 3 for d in r["data"])
        assert r["usage"]["prompt_tokens"] == int(enc["attention_mask"].sum())


@pytest.mark.parametrize(
    "path,body,field,code",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", None),
        ("/rerank", {"query": "a", "documents": []}, "documents", None),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n", None),
        ("/rerank", {"query": "a", "documents": ["word " * 200]}, "documents", "context_length_exceeded"),
        ("/score", {"text_1": "a", "text_2": "word " * 200}, "text_2", "context_length_exceeded"),
        ("/classify", {"input": "word " * 200}, "input", "context_length_exceeded"),
        ("/classify", {"input": []}, "input", None),
        ("/v1/embeddings", {"input": "a"}, "model", "unsupported_endpoint"),
        ("/pooling", {"input": "a"}, "model", "unsupported_endpoint"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model", "unsupported_endpoint"),
    ],
)
def test_bad_input(cross, path, body, field, code):
    err = assert_error(httpx.post(cross[0].url + path, json=body, timeout=60), 400, code)
    assert err["param"] == field, err
    if code == "unsupported_endpoint":  # it says what the model does serve
        assert "/classify" in err["message"] and "/v1/rerank" in err["message"], err


def test_many_labels_give_no_score(classifier):
    err = assert_error(httpx.post(classifier[0].url + "/score", json={"text_1": "a", "text_2": "b"}, timeout=60), 400)
    assert "3 labels" in err["message"] and "/classify" in err["message"]
