"""Beam search in the OpenAI server (`use_beam_search`, `n` = the width): a real `pagedllm serve`
subprocess, the official `openai` client. The choices equal transformers'
generate(num_beams=n, num_return_sequences=n), best first, and their logprobs (logprobs=0 /
logprobs true: the chosen tokens' values, as vLLM reports a search's) sum to transformers'
sequences_scores x len ** length_penalty within 1e-4; a normal request running at the same time
is unaffected; bad input is a 400 naming the field; the beams' blocks come back."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_utils import LONG_PROMPT, assert_error, disconnect_when, wait_idle
from engine.test_beam_search import hf_beam_hypotheses
from engine.test_logprobs import TOL, hf_logprobs

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def beam(**kw):
    return {"use_beam_search": True, **kw}


def _check_choices(choices, hyps, tokenizer, hf_model=None, prompt_ids=None, length_penalty=1.0):
    """choices (text) against transformers' hypotheses (token ids, score), best first; with
    hf_model, their logprobs too: each chosen token's against log_softmax of transformers'
    logits, their sum (the cumulative logprob) against sequences_score x len ** length_penalty.
    -> tokens in all."""
    refs = [t for t, _ in hyps]
    assert [c.text if hasattr(c, "text") else c.message.content for c in choices] == [
        tokenizer.decode(r, skip_special_tokens=True) for r in refs
    ]
    assert [c.finish_reason for c in choices] == ["stop" if r[-1] == 2 else "length" for r in refs]
    for c, (ref_tokens, ref_score) in zip(choices, hyps if hf_model is not None else []):
        values = c.logprobs.token_logprobs if hasattr(c, "text") else [e.logprob for e in c.logprobs.content]
        assert len(values) == len(ref_tokens), (c, ref_tokens)
        ref = hf_logprobs(hf_model, prompt_ids, ref_tokens)
        want = ref[range(len(ref_tokens)), ref_tokens].tolist()
        assert all(abs(v - w) < TOL for v, w in zip(values, want)), (values, want)
        assert abs(sum(values) - ref_score * len(ref_tokens) ** length_penalty) < TOL, (values, ref_score)
    return sum(len(r) for r in refs)


# ------------------------------------------------------------------ equal to transformers
@pytest.mark.timeout(300)
@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.6)])
def test_completion_beam_matches_transformers(client, hf_model, tokenizer, width, length_penalty):
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        n=width,
        logprobs=0,
        extra_body=beam(length_penalty=length_penalty),
    )
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * width))
    num_gen = 0
    for i, p in enumerate(PROMPTS):
        ids = tokenizer(p)["input_ids"]
        hyps = hf_beam_hypotheses(hf_model, ids, width, length_penalty, MAX_TOKENS, num_return=width)
        num_gen += _check_choices(
            r.choices[i * width : (i + 1) * width], hyps, tokenizer, hf_model, ids, length_penalty
        )
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens,
        num_gen,
        prompt_tokens + num_gen,
    )


@pytest.mark.timeout(300)
def test_chat_beam_matches_transformers_and_streams(client, hf_model, tokenizer):
    width = 4
    kw = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, n=width, logprobs=True, extra_body=beam())
    r = client.chat.completions.create(**kw)
    ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    hyps = hf_beam_hypotheses(hf_model, ids, width, 1.0, MAX_TOKENS, num_return=width)
    assert [c.index for c in r.choices] == list(range(width))
    num_gen = _check_choices(r.choices, hyps, tokenizer, hf_model, ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), num_gen)
    # Streaming: each final choice in one chunk, then the usage.
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert [
        (c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason)
        for c in chunks[:-1]
    ] == [(c.index, "assistant", c.message.content, c.finish_reason) for c in r.choices]
    # The same logprobs (up to float summation order: the second search hits the prefix cache).
    for chunk, c in zip(chunks[:-1], r.choices):
        streamed, full = chunk.choices[0].logprobs.content, c.logprobs.content
        assert [e.token for e in streamed] == [e.token for e in full]
        assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, full))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == num_gen


@pytest.mark.timeout(120)
def test_completion_beam_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2, echo=True, extra_body=beam())
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [
        (c.index, c.text, c.finish_reason) for c in full.choices
    ]
    assert all(c.text.startswith(PROMPTS[0]) for c in full.choices)


# ------------------------------------------------------------------ interleaved with normal requests
@pytest.mark.timeout(300)
def test_normal_request_unaffected_by_beam_search(server, client):
    normal = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    alone = client.completions.create(**normal).choices[0].text
    aclient = server.async_client()

    async def together():
        searches = [
            aclient.completions.create(model=MODEL, prompt=p, max_tokens=16, n=4, extra_body=beam()) for p in PROMPTS
        ]
        return await asyncio.gather(aclient.completions.create(**normal), *searches)

    plain, *searched = asyncio.run(together())
    assert plain.choices[0].text == alone
    assert all(len(s.choices) == 4 for s in searched)
    wait_idle(server)


# ------------------------------------------------------------------ bad input, aborts, blocks
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "Hi", "n": 11}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 11}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "temperature": 0.7}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "stop": ["."]}, "stop"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "length_penalty": "long"}, "length_penalty"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "use_beam_search": 1}, "use_beam_search"),
    ],
)
def test_beam_bad_input_is_400(server, path, body, param):
    r = httpx.post(server.url + path, json={"use_beam_search": True, "max_tokens": 4, **body}, timeout=30)
    assert assert_error(r, 400)["param"] == param


@pytest.mark.timeout(120)
def test_disconnect_aborts_search_and_blocks_come_back(server):
    before = wait_idle(server)
    aborted0 = before['pagedllm:request_success_total{finished_reason="abort"}']
    body = {"prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True, "n": 4, "use_beam_search": True}
    # 400 tokens x 4 beams surely outlast the wait: the client leaves while the beams hold blocks.
    disconnect_when(
        server, "/v1/completions", body, lambda m: m["pagedllm:kv_cache_used_blocks"] > 0, "the beams hold KV blocks"
    )
    after = wait_idle(server)
    assert after['pagedllm:request_success_total{finished_reason="abort"}'] == aborted0 + 1
    assert after["pagedllm:kv_cache_usage_perc"] == 0
