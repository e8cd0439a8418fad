"""Speculative decoding through the server: a tiny-model server with n-gram drafts streams, through
the official openai client, the same greedy completions as the shared server without speculation
(same weights: random:tiny; the engine without speculation equals transformers elsewhere), and
/metrics counts the drafts with vLLM's names; the stats log line reports the acceptance."""

import json
import time

import pytest
from server_utils import TINY_SERVER_MAX_MODEL_LEN, tiny_server, wait_metrics

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [40, 41, 40, 41, 40], [300, 12, 77, 300, 12]]


@pytest.fixture(scope="module")
def server():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    srv = tiny_server(TINY_SERVER_MAX_MODEL_LEN, "--speculative-config", spec)
    yield srv
    srv.close()


def streamed(srv, prompt) -> str:
    client = srv.client()
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=40,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(chunk.choices[0].text for chunk in stream)


def test_streamed_greedy_equals_the_server_without_speculation(server, tiny_shared_server):
    for prompt in PROMPTS:
        assert streamed(server, prompt) == streamed(tiny_shared_server, prompt)
    m = wait_metrics(server, lambda m: m.get("pagedllm:spec_decode_num_drafts_total", 0) > 0, "drafts counted")
    assert m["pagedllm:spec_decode_num_accepted_tokens_total"] > 0
    assert m['pagedllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert (
        wait_metrics(tiny_shared_server, lambda m: True, "metrics").get("pagedllm:spec_decode_num_drafts_total", 0) == 0
    )
    # The stats line is logged on the server's stats interval, which can lag the metrics under load.
    deadline = time.monotonic() + 60
    while "SpecDecoding: acceptance rate" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "SpecDecoding: acceptance rate" in server.log_text()
