"""Speculative decoding through the server: a default-model server with n-gram drafts streams,
through the official openai client, the greedy completion transformers gives token for token
(ties allowed as in the correctness rules), and /metrics counts drafts with vLLM's names."""
import json

import pytest
from greedy_utils import TIE_EPS, hf_greedy
from server_utils import DEFAULT_SERVER_ARGS, RemoteServer, wait_metrics

PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "# The two functions again, unchanged:\ndef add(a, b):\n")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(model_dir):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    srv = RemoteServer(DEFAULT_SERVER_ARGS + ["--model", model_dir, "--speculative-config", spec])
    yield srv
    srv.close()


def test_streamed_greedy_equals_transformers(server, client, tokenizer, hf_model):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    (ref, gaps), = hf_greedy(hf_model, [prompt_ids], MAX_TOKENS)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompt_ids,
                                       max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream)
    # Where the texts first part, the reference's top-2 logits must be a tie.
    for j in range(len(ref)):
        if not text.startswith(tokenizer.decode(ref[:j + 1])):
            assert gaps[j] < TIE_EPS, f"token {j} differs: {text!r} vs {tokenizer.decode(ref)!r}"
            break
    else:
        assert text == tokenizer.decode(ref)
    m = wait_metrics(server, lambda m: m.get("pagedllm:spec_decode_num_drafts_total", 0) > 0, "drafts counted")
    assert m["pagedllm:spec_decode_num_accepted_tokens_total"] > 0
    assert m['pagedllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert "SpecDecoding: acceptance rate" in server.log_text()
