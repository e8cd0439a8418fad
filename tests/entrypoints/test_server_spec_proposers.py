"""The model-based proposers through the server, streamed through the official openai client:

- a draft model from an HF directory (`{"model": DIR}`): the tiny random model drafting for
  itself, so every greedy draft is the target's own next token; the streamed text equals the
  shared server's without speculation, and /metrics shows the drafts accepted (a draft cache
  that lost its place would draft wrong tokens and be rejected);
- MTP (`{"method": "mtp"}`) on a tiny random DeepseekV3 with a next-n layer whose drafts are
  mostly right (spec_decode/test_mtp_proposer.py's `predictable_dir`): the streamed text equals
  the engine's without speculation, whose tokens equal transformers' greedy.
"""

import json

import pytest
from server_utils import TINY_SERVER_MAX_MODEL_LEN, RemoteServer, tiny_server, wait_metrics
from spec_decode.test_mtp_proposer import predictable_dir  # noqa: F401 (a fixture)

from models.test_deepseek_v3 import hf_greedy, prompts_with_shared_prefix
from pagedllm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [40, 41, 40, 41, 40], [300, 12, 77, 300, 12]]


def streamed(srv, prompt, max_tokens: int, **extra) -> str:
    client = srv.client()
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, **extra},
    )
    return "".join(chunk.choices[0].text for chunk in stream)


@pytest.fixture(scope="module")
def draft_dir_server():
    from pagedllm.models.random_model import random_model_dir

    spec = json.dumps({"model": str(random_model_dir("random:tiny")), "num_speculative_tokens": 3})
    srv = tiny_server(TINY_SERVER_MAX_MODEL_LEN, "--speculative-config", spec)
    yield srv
    srv.close()


def test_draft_directory_streams_the_greedy_text(draft_dir_server, tiny_shared_server):
    for prompt in PROMPTS:
        assert streamed(draft_dir_server, prompt, 40) == streamed(tiny_shared_server, prompt, 40)
    m = wait_metrics(
        draft_dir_server, lambda m: m.get("pagedllm:spec_decode_num_drafts_total", 0) > 0, "drafts counted"
    )
    drafted, accepted = (
        m["pagedllm:spec_decode_num_draft_tokens_total"],
        m["pagedllm:spec_decode_num_accepted_tokens_total"],
    )
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted)


def test_mtp_streams_the_greedy_text(predictable_dir):  # noqa: F811 (the imported fixture)
    path, model, _, _ = predictable_dir
    prompts = prompts_with_shared_prefix()[0]
    n = 12
    # The reference: transformers' greedy tokens = the engine's without speculation, whose text the
    # server with MTP must stream (EOS masked on both sides: min_tokens = max_tokens).
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    offline = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
        use_tqdm=False,
    )
    del llm
    assert [o.outputs[0].token_ids for o in offline] == hf_greedy(model, prompts)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    srv = RemoteServer(
        [
            "--model",
            str(path),
            "--dtype",
            "float32",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            "0.01",
            "--speculative-config",
            spec,
        ]
    )
    try:
        for p, ref in zip(prompts, offline):
            assert streamed(srv, p, n, min_tokens=n) == ref.outputs[0].text
        m = wait_metrics(
            srv, lambda m: m.get("pagedllm:spec_decode_num_accepted_tokens_total", 0) > 0, "accepted drafts counted"
        )
        assert m["pagedllm:spec_decode_num_drafts_total"] > 0
    finally:
        srv.close()
