"""Logprob values through the OpenAI server (a real `pagedllm serve` on the tiny random model, the
official `openai` client) against log_softmax of transformers' raw logits within 1e-4:
completions `logprobs` and chat `logprobs` / `top_logprobs`, streamed and not, with a temperature
and penalties that change the processed logits but not the reported values. The random model's
tokenizer names every id ("w123"), so a reported token string maps back to its id."""

from __future__ import annotations

import pytest

from server_utils import TINY, TINY_CHAT_TEMPLATE
from engine.test_logprobs import check_position, hf_logprobs, tiny_dir, tiny_hf  # noqa: F401 (fixtures)

PROMPT = [5, 17, 33, 101, 7, 250, 9, 64]
MESSAGES = [
    {"role": "user", "content": "w12 w400 w33 w77"},
    {"role": "assistant", "content": "w8 w9"},
    {"role": "user", "content": "w310"},
]
SAMPLING = dict(
    temperature=0.7,
    seed=11,
    presence_penalty=0.6,
    frequency_penalty=0.4,
    max_tokens=10,
    extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
)


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_shared_server):
    return tiny_shared_server


@pytest.fixture(scope="module")
def token_id(tiny_dir):
    """Token string (as the server reports it) -> id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    names = {tok.decode([i]): i for i in range(len(tok))}
    assert len(names) == len(tok)
    return names


def check_completion_logprobs(hf, prompt_ids, tokens, token_logprobs, top_logprobs, k, token_id, where):
    """Completions' form: per position the sampled token, its value and a {token: value} dict of
    the top k plus the sampled token (k + 1 entries when it is not among them)."""
    ids = [token_id[t] for t in tokens]
    ref = hf_logprobs(hf, prompt_ids, ids)
    for i, (tid, lp, tops) in enumerate(zip(ids, token_logprobs, top_logprobs)):
        entries = sorted(((token_id[t], v) for t, v in tops.items()), key=lambda e: -e[1])
        assert len(entries) in (k, k + 1) and tid in dict(entries), (where, i, tops)
        if len(entries) == k + 1:  # the sampled token is outside the top k: least likely of all
            assert entries[-1][0] == tid, (where, i, tops)
            entries = entries[:k]
        check_position(ref[i], tid, lp, entries, k, where=f"{where} token {i}")
    return ids


def check_chat_logprobs(hf, prompt_ids, content, k, token_id, where):
    """Chat's form: per position the sampled token and value, and the top k in rank order."""
    ids = [token_id[c.token] for c in content]
    ref = hf_logprobs(hf, prompt_ids, ids)
    for i, (tid, c) in enumerate(zip(ids, content)):
        assert c.bytes == list(c.token.encode()), (where, i, c)
        check_position(
            ref[i],
            tid,
            c.logprob,
            [(token_id[t.token], t.logprob) for t in c.top_logprobs],
            k,
            where=f"{where} token {i}",
        )
    return ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [0, 5])
def test_completion_logprobs_equal_transformers(client, tiny_hf, token_id, k):
    kw = dict(model=TINY, prompt=PROMPT, logprobs=k, **SAMPLING)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    ids = check_completion_logprobs(tiny_hf, PROMPT, lp.tokens, lp.token_logprobs, lp.top_logprobs, k, token_id, "full")
    assert len(ids) == 10 and r.choices[0].text.split() == lp.tokens
    # Streamed: the chunks' logprobs put together are the same tokens and values.
    tokens, values, tops = [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            tops += c.logprobs.top_logprobs
    assert tokens == lp.tokens
    check_completion_logprobs(tiny_hf, PROMPT, tokens, values, tops, k, token_id, "stream")


@pytest.mark.timeout(120)
def test_chat_logprobs_equal_transformers(client, tiny_hf, token_id, tiny_dir):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(tiny_dir).apply_chat_template(
        MESSAGES, chat_template=TINY_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert prompt_ids == [12, 400, 33, 77, 8, 9, 310]
    kw = dict(model=TINY, messages=MESSAGES, logprobs=True, top_logprobs=4, **SAMPLING)
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(prompt_ids)
    content = r.choices[0].logprobs.content
    ids = check_chat_logprobs(tiny_hf, prompt_ids, content, 4, token_id, "full")
    assert len(ids) == 10
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    check_chat_logprobs(tiny_hf, prompt_ids, streamed, 4, token_id, "stream")
    # logprobs without top_logprobs: the sampled tokens' values, no alternatives.
    r0 = client.chat.completions.create(**{**kw, "top_logprobs": None})
    check_chat_logprobs(tiny_hf, prompt_ids, r0.choices[0].logprobs.content, 0, token_id, "top 0")
