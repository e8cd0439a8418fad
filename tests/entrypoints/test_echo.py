"""/v1/completions with echo and logprobs (what lm-evaluation-harness' local-completions sends for
every log-likelihood task), max_tokens 0 with echo, and vLLM's prompt_logprobs extra field,
through a real server and the official openai client, against log_softmax of transformers'
logits on the same weights within 1e-4 (the tiny random model: its tokenizer names every id
"w123", so a reported token string maps back to its id)."""

from __future__ import annotations

import openai
import pytest

from server_utils import TINY, assert_error
from engine.test_logprobs import tiny_dir, tiny_hf  # noqa: F401 (fixtures)
from entrypoints.test_server_logprobs import check_completion_logprobs, server, token_id  # noqa: F401
from engine.test_prompt_logprobs import check_prompt_logprobs

PROMPT = [5, 17, 33, 101, 7, 250, 9, 64, 12]
GREEDY = dict(model=TINY, temperature=0, extra_body={"ignore_eos": True})


def check_echo(hf, lp, prompt, k, token_id, where):
    """The prompt's tokens then the completion's: no logprob for the first, the others (and
    their top k) as transformers gives them at the position before; text offsets add up."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, where
    assert [token_id[t] for t in lp.tokens[: len(prompt)]] == prompt, where
    check_completion_logprobs(
        hf, prompt[:1], lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], k, token_id, where
    )
    assert lp.text_offset[0] == 0, where
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens)), where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [0, 3])
def test_echo_logprobs_equal_transformers(client, tiny_hf, token_id, k):
    r = client.completions.create(prompt=PROMPT, max_tokens=4, echo=True, logprobs=k, **GREEDY)
    c = r.choices[0]
    prompt_text = client.completions.create(prompt=PROMPT, max_tokens=0, echo=True, **GREEDY).choices[0].text
    assert c.text.startswith(prompt_text) and len(c.logprobs.tokens) == len(PROMPT) + 4
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 4
    check_echo(tiny_hf, c.logprobs, PROMPT, k, token_id, "full")
    # Streamed: the first chunk echoes the prompt with its logprobs; all chunks together are the same.
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in client.completions.create(prompt=PROMPT, max_tokens=4, echo=True, logprobs=k, stream=True, **GREEDY):
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            values += ch.logprobs.token_logprobs
            tops += ch.logprobs.top_logprobs
            offsets += ch.logprobs.text_offset
    assert text == c.text and tokens == c.logprobs.tokens and offsets == c.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-5)
    assert tops[1:] == [pytest.approx(t, abs=1e-5) for t in c.logprobs.top_logprobs[1:]]


@pytest.mark.timeout(120)
def test_echo_max_tokens_zero_is_the_prompt(client, tiny_hf, token_id):
    """lm-eval's loglikelihood requests: the prompt alone, scored; nothing generated is shown."""
    prompts = [PROMPT, PROMPT[:4]]
    r = client.completions.create(prompt=prompts, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 0
    for p, c in zip(prompts, r.choices):
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == len(p)
        check_echo(tiny_hf, c.logprobs, p, 1, token_id, f"{len(p)} tokens")
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True, **GREEDY))
    streamed = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    assert streamed == r.choices[0].logprobs.tokens and chunks[-1].choices[0].finish_reason == "length"
    # Without echo, max_tokens 0 is still refused.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=PROMPT, max_tokens=0, **GREEDY)


@pytest.mark.timeout(120)
def test_prompt_logprobs_extra_field(client, tiny_hf):
    """vLLM's prompt_logprobs: per choice on completions, on the response for chat; None first."""
    r = client.completions.create(prompt=PROMPT, max_tokens=2, **{**GREEDY, "extra_body": {"prompt_logprobs": 2}})
    check_prompt_logprobs(tiny_hf, PROMPT, _as_logprobs(r.choices[0].model_extra["prompt_logprobs"]), 2, "completions")
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "w12 w400 w33"}],
        max_tokens=2,
        **{**GREEDY, "extra_body": {"prompt_logprobs": 0}},
    )
    plps = chat.model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == chat.usage.prompt_tokens
    assert all(len(pos) in (1, 2) for pos in plps[1:])


def _as_logprobs(plps):
    from pagedllm.outputs import Logprob

    return [None if pos is None else {int(t): Logprob(**v) for t, v in pos.items()} for pos in plps]


@pytest.mark.timeout(60)
def test_models_retrieve_and_stream_fields(server, client):
    m = client.models.retrieve(TINY)
    assert m.id == TINY and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    import httpx

    assert_error(httpx.get(server.url + "/v1/models/no-such-model"), 404, "model_not_found")
    for path, body, param in [
        ("/v1/completions", {"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w1"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "w1", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "w1", "prompt_logprobs": 99}, "prompt_logprobs"),
    ]:
        err = assert_error(httpx.post(server.url + path, json={"model": TINY, **body}), 400)
        assert err["param"] == param, (body, err)
