"""`pagedllm run-batch` end to end, as a real subprocess on `random:tiny`: completions and chat
lines answer what the offline LLM answers for the same greedy requests, embeddings lines (the
pooling runner) what LLM.embed gives; /v1/rerank and /score lines on an encoder cross-encoder
what `pagedllm serve` of it answers; malformed lines get an error record in their place and the
others still run; an API error (a 400) is its line's response body, as in OpenAI's batch output."""

import json
import subprocess
import sys

import httpx
import pytest

from encoder_dirs import random_encoder
from pagedllm import LLM, SamplingParams
from server_utils import REPO, TINY, TINY_CHAT_TEMPLATE, RemoteServer

MAX_MODEL_LEN = 64
ENGINE = ["--model", TINY, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "0.01"]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [300, 301]]
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


def run_batch(tmp_path, lines: list[str], *args: str, engine: list[str] = ENGINE) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(dst), *engine, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Running batch: 100%" in r.stderr  # the progress bar ran to the end
    return [json.loads(line) for line in dst.read_text().splitlines()]


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_completions_and_chat_equal_offline_greedy_and_bad_lines_get_errors(tmp_path):
    lines = [
        line(f"cmpl-{i}", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})
        for i, p in enumerate(PROMPTS)
    ]
    lines += [
        line("chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}),
        "{not json",
        json.dumps(["a", "list"]),
        line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        line("where", "/v1/images", {"prompt": "x"}),
        line("streamed", "/v1/completions", {"prompt": [5], "stream": True}),
        line("bad-value", "/v1/completions", {"prompt": [5], "max_tokens": -1}),
        line("last", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}),
    ]
    out = run_batch(tmp_path, lines, "--chat-template", TINY_CHAT_TEMPLATE)
    assert len(out) == len(lines)
    assert len({r["id"] for r in out}) == len(out)
    llm = LLM(TINY, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    chat = llm.chat(MESSAGES, greedy, use_tqdm=False, chat_template=TINY_CHAT_TEMPLATE)[0].outputs[0].text
    for i in range(3):
        rec = out[i]
        assert rec["custom_id"] == f"cmpl-{i}" and rec["error"] is None
        assert rec["response"]["status_code"] == 200
        assert rec["response"]["request_id"] == rec["response"]["body"]["id"]
        assert rec["response"]["body"]["choices"][0]["text"] == want[i]
    assert out[3]["response"]["body"]["choices"][0]["message"]["content"] == chat
    assert out[-1]["response"]["body"]["choices"][0]["text"] == want[0]
    errors = {i: (out[i]["custom_id"], out[i]["error"]["message"]) for i in range(4, 9)}
    assert all(out[i]["response"] is None and out[i]["error"]["code"] == "invalid_request" for i in errors)
    assert errors[4][0] is None and "not JSON" in errors[4][1]
    assert errors[5] == (None, "the line must be a JSON object, got list")
    assert errors[6] == ("get", "method must be 'POST', got 'GET'")
    assert errors[7][0] == "where" and "url must be one of /v1/completions" in errors[7][1]
    assert errors[8] == ("streamed", "body.stream must be false or absent: a batch has no streams")
    bad = out[9]["response"]
    assert out[9]["error"] is None and bad["status_code"] == 400
    assert bad["body"]["error"]["param"] == "max_tokens"


def test_embeddings_equal_offline(tmp_path):
    lines = [line(f"emb-{i}", "/v1/embeddings", {"input": p}) for i, p in enumerate(PROMPTS)]
    out = run_batch(tmp_path, lines, "--runner", "pooling")
    llm = LLM(TINY, max_model_len=MAX_MODEL_LEN, runner="pooling")
    want = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
    for rec, vec in zip(out, want):
        assert rec["response"]["status_code"] == 200, rec
        assert rec["response"]["body"]["data"][0]["embedding"] == pytest.approx(vec, abs=1e-6)


def test_rerank_and_score_equal_the_server(tmp_path):
    model = tmp_path / "cross-encoder"
    random_encoder(model, "BertForSequenceClassification", None, num_labels=1, init_range=0.2)
    docs = ["paged attention stores the KV cache in blocks", "a fox", "hi"]
    requests = [
        ("/v1/rerank", {"query": "what is paged attention?", "documents": docs, "top_n": 2}),
        ("/rerank", {"query": "a fox", "documents": [{"text": d} for d in docs], "return_documents": False}),
        ("/score", {"text_1": "a fox", "text_2": docs}),
        ("/v1/score", {"text_1": docs[:2], "text_2": docs[1:]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}),
    ]  # a 400, as its body
    lines = [line(f"req-{i}", url, body) for i, (url, body) in enumerate(requests)]
    out = run_batch(tmp_path, lines + [line("bad", "/v1/classify", {"input": "a"})], engine=["--model", str(model)])
    srv = RemoteServer([str(model)])
    try:
        want = [httpx.post(srv.url + url, json=body, timeout=60) for url, body in requests]
    finally:
        srv.close()
    for rec, w in zip(out, want):
        got = rec["response"]
        assert got["status_code"] == w.status_code, rec
        strip = ("id", "created")  # each answer's own
        assert_same(
            {k: v for k, v in got["body"].items() if k not in strip},
            {k: v for k, v in w.json().items() if k not in strip},
        )
    assert len(out[0]["response"]["body"]["results"]) == 2 and out[4]["response"]["status_code"] == 400
    assert out[-1]["custom_id"] == "bad" and "url must be one of" in out[-1]["error"]["message"]


def assert_same(got, want):
    """Equal JSON, floats within 1e-6 (the batch runs its lines in other padded batches than the server)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-6)
    elif isinstance(want, (list, dict)):
        assert type(got) is type(want) and len(got) == len(want), (got, want)
        for k in want if isinstance(want, dict) else range(len(want)):
            assert_same(got[k], want[k])
    else:
        assert got == want
