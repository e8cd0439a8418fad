"""The OpenAI-compatible server, end to end: a real `pagedllm serve` subprocess on 127.0.0.1,
talked to with the official `openai` client and httpx. The session's `default_server` (shared
with test_server_beam.py); the last test of the session stops it with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from server_utils import (
    DEFAULT_SERVER_MAX_MODEL_LEN,
    LONG_PROMPT,
    LONG_STEP_TOKEN,
    assert_error,
    core_frozen,
    disconnect_when,
    wait_aborted,
    wait_idle,
    wait_metrics,
    wait_session_gone,
)

pytestmark = pytest.mark.model

MAX_MODEL_LEN = DEFAULT_SERVER_MAX_MODEL_LEN
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def post(server, path, body=None, content=None, **kw):
    kw.setdefault("timeout", 60)
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, **kw)


# ------------------------------------------------------------------ basics
@pytest.mark.timeout(60)
def test_models_health_version_ready_line(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    log = server.log_text()
    ready = [line for line in log.splitlines() if "ready: http://127.0.0.1:%d" % server.port in line]
    assert len(ready) == 1, log


@pytest.mark.timeout(60)
def test_tokenize_detokenize(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": PROMPT})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == tokenizer(PROMPT)["input_ids"] and r.json()["count"] == len(ids)
    assert r.json()["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPT
    r = post(server, "/tokenize", {"messages": CHAT})
    assert r.json()["tokens"] == list(
        tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


# ------------------------------------------------------------------ streaming == non-streaming
def _counts(usage):
    """Token counts of a usage object (the second of two equal requests may find more cached)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


@pytest.mark.timeout(120)
def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(full.usage)
    assert all(c.usage is None for c in chunks[:-1])
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


@pytest.mark.timeout(120)
def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert _counts(chunks[-1].usage) == _counts(full.usage)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    # echo: the prompt comes first
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == PROMPT + full.choices[0].text


@pytest.mark.timeout(60)
def test_raw_stream_ends_with_done(server):
    with httpx.stream(
        "POST", server.base_url + "/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 3, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


# ------------------------------------------------------------------ n, logprobs, stop, length, usage
@pytest.mark.timeout(120)
def test_n3(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=True
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "Once upon a time"],
        n=3,
        temperature=0.8,
        seed=1,
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 6 * 4
    # streamed n=3: every index gets text and a finish reason
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=0.8, seed=1, max_tokens=4, stream=True)
    )
    assert {c.choices[0].index for c in chunks if c.choices[0].finish_reason} == {0, 1, 2}


@pytest.mark.timeout(120)
def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(tlp)  # greedy: top-1
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for c in content:
        assert c.logprob <= 0 and isinstance(c.bytes, list)
        assert len(c.top_logprobs) == 4
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    assert bytes(b for c in content for b in c.bytes).decode() == r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    # streamed logprobs come with their tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


@pytest.mark.timeout(120)
def test_stop_and_length(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == base[: base.index(stop)]
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0)
    assert r2.choices[0].message.content == r.choices[0].message.content


@pytest.mark.timeout(60)
def test_usage_is_exact(server, client, tokenizer):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.timeout(60)
def test_token_id_prompts(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text


# ------------------------------------------------------------------ concurrency == offline
@pytest.fixture(scope="module")
def offline_reference(model_dir):
    """Greedy outputs of the offline LLM on the concurrency test's prompts (its own engine)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 << 20)
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    ref = {p: o.outputs[0].text for p, o in zip(prompts, outs)}
    del llm
    import gc

    gc.collect()
    return ref


@pytest.mark.timeout(240)
def test_32_concurrent_requests_greedy_equal_offline(server, offline_reference):
    aclient = server.async_client()
    greedy_prompts = list(offline_reference)

    async def one(i):
        if i < 8:
            r = await aclient.completions.create(model=MODEL, prompt=greedy_prompts[i], max_tokens=10, temperature=0)
            return "greedy", greedy_prompts[i], r
        if i < 20:  # sampled, streamed
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"Story {i}:", max_tokens=10, temperature=0.9, seed=i, stream=True
            )
            text, fin = "", None
            async for ch in stream:
                text += ch.choices[0].text
                fin = ch.choices[0].finish_reason or fin
            return "stream", text, fin
        r = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=10, temperature=0.7, seed=i
        )
        return "chat", None, r

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    t0 = time.time()
    results = asyncio.run(run_all())
    assert len(results) == 32
    for kind, key, r in results:
        if kind == "greedy":
            assert r.choices[0].text == offline_reference[key], key
        elif kind == "stream":
            assert r in ("stop", "length")
        else:
            assert r.choices[0].finish_reason in ("stop", "length")
    print(f"32 concurrent requests in {time.time() - t0:.1f} s")


# ------------------------------------------------------------------ disconnects free blocks
# The client leaves with the engine core frozen (server_utils.core_frozen) and the core resumes
# only once the API server has aborted the request: the request cannot run to its end first,
# however fast or slow the machine. Its many slow steps (LONG_PROMPT: server_utils) keep it
# running until the freeze, through any stall of the client or the API process.
LONG_TOKENS = MAX_MODEL_LEN - 64
HOLDS_BLOCKS = (
    lambda m: m["pagedllm:kv_cache_used_blocks"] > 0 and m["pagedllm:num_requests_running"] == 1,
    "the request runs and holds KV blocks",
)


def _finished(m, reason):
    return m[f'pagedllm:request_success_total{{finished_reason="{reason}"}}']


def _assert_aborted_and_freed(server, before):
    """The request ended as aborted (not run to its end) and its blocks came back."""
    after = wait_idle(server)
    assert _finished(after, "abort") == _finished(before, "abort") + 1
    assert _finished(after, "length") == _finished(before, "length"), "it ran to its end: no disconnect seen"
    assert after["pagedllm:kv_cache_usage_perc"] == 0


LONG_CHAT = [{"role": "user", "content": LONG_PROMPT}]


def test_long_prompt_holds_the_slow_step_token(tokenizer):
    assert LONG_STEP_TOKEN in tokenizer.encode(LONG_PROMPT)
    assert LONG_STEP_TOKEN in tokenizer.apply_chat_template(LONG_CHAT, tokenize=True, return_dict=False)


def _ended(m, before) -> dict:
    """finished_reason -> how many more requests ended since `before`."""
    out = {}
    for k, v in m.items():
        if k.startswith("pagedllm:request_success_total{") and "model_name" not in k:
            if v > before.get(k, 0):
                out[k.split('"')[1]] = v - before.get(k, 0)
    return out


@pytest.mark.timeout(300)
def test_stream_disconnect_frees_blocks(server):
    # The request has ~48 s of slow steps to go when its first token is read; only a stall of
    # this process or of the API process that long lets it reach its end before the freeze. That
    # run says nothing of disconnects and is tried again; any other end fails.
    for _ in range(3):
        before = wait_idle(server)
        body = {"prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "stream": True, "ignore_eos": True, "temperature": 0}
        t0 = time.monotonic()
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert '"error"' not in first, first
            waited = time.monotonic() - t0
            with core_frozen(server):
                # The stats that came with the first token say it runs, and only a message that
                # says it ended can follow them, from before the freeze.
                holds, what = HOLDS_BLOCKS
                m = wait_metrics(server, lambda m: holds(m) or _ended(m, before), what)
                if holds(m):
                    r.close()  # the client goes away
                    wait_aborted(server, before)
        ended = _ended(m, before)
        if not holds(m):
            assert ended == {"length": 1}, f"ended before the disconnect: {ended}; first token after {waited:.1f} s"
            continue
        # the core resumes, gets the abort, the blocks come back
        _assert_aborted_and_freed(server, before)
        return
    pytest.fail("the request ran to its end before the freeze in every try")


@pytest.mark.timeout(300)
def test_non_stream_disconnect_frees_blocks(server):
    before = wait_idle(server)
    body = {"messages": LONG_CHAT, "max_tokens": LONG_TOKENS, "ignore_eos": True}
    disconnect_when(server, "/v1/chat/completions", body, *HOLDS_BLOCKS)
    _assert_aborted_and_freed(server, before)


@pytest.mark.timeout(60)
def test_metrics_exposed(server):
    # Its own requests, so that it passes alone too: one ends on length; the same greedy
    # prompt with that text as a stop string ends on stop.
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = post(server, "/v1/completions", body).json()["choices"][0]
    assert first["finish_reason"] == "length" and first["text"].strip()
    second = post(server, "/v1/completions", {**body, "stop": [first["text"]]}).json()["choices"][0]
    assert second["finish_reason"] == "stop"
    m = server.metrics()
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert m[f"pagedllm:{name}_count"] > 0, name
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
    ):
        assert f"pagedllm:{name}" in m, name
    assert m['pagedllm:request_success_total{finished_reason="length"}'] > 0
    assert m['pagedllm:request_success_total{finished_reason="stop"}'] > 0
    assert m["pagedllm:generation_tokens_total"] > 0
    deadline = time.monotonic() + 60  # the periodic stats line (every --log-stats-interval s)
    while "Running: " not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "Running: " in server.log_text()


# ------------------------------------------------------------------ bad input
LONG = "hello " * 1000  # ~1000 tokens


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, None),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 10**12}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, None),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, None),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 5}, None),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999999": 1}}, None),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, None),
        ("/v1/completions", {"prompt": "hi", "top_k": -5}, None),
        ("/v1/completions", {"prompt": "hi", "min_p": 2}, None),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, None),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, None),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, None),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, None),
        ("/v1/completions", {"prompt": "hi", "best_of": 1, "n": 2}, None),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        # a text-only model: the image part is named
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, None),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "assistant", "content": "x"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
                "max_tokens": "x",
            },
            "max_tokens",
        ),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_input_400(server, path, body, param):
    err = assert_error(post(server, path, body), 400)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "messages, param, role",
    [
        ([{"role": ""}], "messages[0].role", ""),
        ([{"role": "", "content": "hi"}], "messages[0].role", ""),
        ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], "messages[1].role", "robot"),
        ([{"role": "User", "content": "hi"}], "messages[0].role", "User"),
    ],
)
def test_unknown_role_400(client, messages, param, role):
    """A role that is not a chat role is refused (as OpenAI and vLLM do), not rendered as text."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    err = e.value.body
    assert err["param"] == param, err
    assert (
        f"{param}: {role!r} is not a chat role; allowed: system, developer, user, assistant, tool" == err["message"]
    ), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'"text"',
        b"",
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "temperature": Infinity}',
        b"\xff\xfe",
    ],
)
def test_malformed_bodies_400(server, content):
    assert_error(post(server, "/v1/completions", content=content), 400)


@pytest.mark.timeout(60)
def test_unknown_model_404_and_routes(server, client):
    assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404, "model_not_found")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.base_url + "/completions"), 405)


@pytest.mark.timeout(60)
def test_context_length_400_with_numbers(server, client, tokenizer):
    n_prompt = len(tokenizer(LONG)["input_ids"])
    r = post(server, "/v1/completions", {"prompt": LONG, "max_tokens": 100})
    err = assert_error(r, 400, "context_length_exceeded")
    assert err["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{n_prompt + 100} tokens ({n_prompt} in the prompt, 100 in the completion). "
        "Please reduce the length of the prompt or completion."
    ), err
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=200)
    msg = e.value.body["message"]
    assert (
        f"maximum context length is {MAX_MODEL_LEN} tokens" in msg and "in the messages, 200 in the completion" in msg
    )
    # without max_tokens, a prompt that fills the context
    err = assert_error(
        post(server, "/v1/completions", {"prompt": LONG * 2, "max_tokens": None}), 400, "context_length_exceeded"
    )
    assert "resulted in" in err["message"]


@pytest.mark.timeout(120)
def test_bad_input_does_not_disturb_others(server, client):
    """A greedy stream runs while a burst of bad requests hits the server: it ends as it would alone."""
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12)
    expected = client.completions.create(**kw).choices[0].text
    stream = client.completions.create(stream=True, **kw)
    bad = [
        {"prompt": 5},
        {"prompt": "hi", "top_p": 7},
        {"prompt": [10**9]},
        {"prompt": LONG, "max_tokens": 500},
        {"prompt": "hi", "seed": 2**80},
        {"model": "x", "prompt": "hi"},
    ]
    text = ""
    for i, ch in enumerate(stream):
        text += ch.choices[0].text
        if i < len(bad):
            assert 400 <= post(server, "/v1/completions", bad[i]).status_code < 500
    assert text == expected


# ------------------------------------------------------------------ fuzz
def _fuzz_strategies():
    """(path, body): a valid body (small max_tokens) with 0 to 3 of its fields, or new ones,
    replaced by junk of any JSON type: the validation of every field and the engine's paths
    are both exercised."""
    from hypothesis import strategies as st

    junk = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
        st.lists(st.integers(-5, 60000), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2),
    )
    sampling = {
        "model": st.just(MODEL),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "n": st.integers(1, 3),
        "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "2", "49151"]), st.floats(-100, 100), max_size=2),
        "top_k": st.sampled_from([-1, 0, 1, 5, 100000]),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "min_tokens": st.integers(0, 2),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 49151), max_size=2),
        "skip_special_tokens": st.booleans(),
        "user": st.text(max_size=4),
    }
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
    )
    endpoints = {
        "/v1/completions": (
            {
                "prompt": st.one_of(
                    st.text(min_size=1, max_size=20),
                    st.lists(st.integers(0, 49151), min_size=1, max_size=4),
                    st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=2),
                ),
                "max_tokens": st.integers(1, 3),
            },
            {**sampling, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(3, 4)},
        ),
        "/v1/chat/completions": (
            {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
            {
                **sampling,
                "logprobs": st.booleans(),
                "top_logprobs": st.integers(0, 5),
                "add_generation_prompt": st.booleans(),
                "max_completion_tokens": st.integers(1, 3),
            },
        ),
        "/tokenize": ({"prompt": st.text(max_size=10)}, {"model": st.just(MODEL), "add_special_tokens": st.booleans()}),
        "/detokenize": ({"tokens": st.lists(st.integers(0, 49151), max_size=4)}, {"model": st.just(MODEL)}),
    }

    @st.composite
    def case(draw):
        path = draw(st.sampled_from(sorted(endpoints)))
        required, optional = endpoints[path]
        body = draw(st.fixed_dictionaries(required, optional=optional))
        names = sorted(set(required) | set(optional)) + ["unknown_field"]
        for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
            if draw(st.booleans()) and name in body and name != "max_tokens":
                del body[name]
            else:
                body[name] = draw(junk)
        # Keep the valid ones short: no long generations (null max_tokens means "to the context").
        mt = body.get("max_tokens")
        if path == "/v1/chat/completions" and (type(mt) is not int or mt > 3):
            body.setdefault("max_completion_tokens", 3)
        if path == "/v1/completions" and ("max_tokens" in body and mt is None or type(mt) is int and 3 < mt < 2000):
            body["max_tokens"] = 3
        return path, body

    return case()


@pytest.mark.timeout(240)
def test_fuzz_request_schema_no_5xx(server):
    from hypothesis import HealthCheck, given, settings

    seen = {"ok": 0, "4xx": 0}

    @settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(_fuzz_strategies())
    def check(case):
        path, body = case
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if r.status_code >= 400:
            assert_error(r, r.status_code)
            seen["4xx"] += 1
        else:
            seen["ok"] += 1
            if r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
            else:
                r.json()

    check()
    print(seen)
    assert seen["4xx"] > 0 and seen["ok"] > 0
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.timeout(120)
def test_prefix_cache_reported_in_usage_and_metrics(server, client):
    """The same long prompt twice: the second finds its blocks cached, usage and /metrics say so."""
    prompt = "The museum of lighthouses keeps lamps, lenses and logbooks. " * 12
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    m = wait_idle(server)
    assert m["pagedllm:prefix_cache_hits_total"] >= cached
    assert 0 < m["pagedllm:prefix_cache_hit_rate"] <= 1


@pytest.mark.timeout(120)
def test_reset_prefix_cache_endpoint(server, client):
    """POST /reset_prefix_cache (development mode): a prompt cached by its first request is not
    found after the reset; refused with a 409 error object while a request is running."""
    prompt = "A ledger of tides, winds and the harbour's cargo, written every morning. " * 10
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(**kw)
    assert client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
    assert client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    # A long request (LONG_PROMPT: each of its steps sleeps) in flight until the stream is closed.
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 800, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a closed line iterator closes the stream (an abort)
        next(line for line in lines if line.startswith("data: "))
        busy = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "requests_running", busy.text
    wait_idle(server)
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200


# ------------------------------------------------------------------ shutdown (last: it stops the server)
@pytest.mark.stops_server
@pytest.mark.timeout(120)
def test_sigterm_with_request_in_flight_exits_cleanly(server):
    body = {"prompt": "Count to one thousand:", "max_tokens": 800, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        # The core frozen, the request cannot run to its end: the signal's abort ends the stream.
        with core_frozen(server):
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # the stream ends (an error event, then [DONE])
    code = server.proc.wait(120)  # (a second SIGTERM would force uvicorn's exit)
    assert code == 0, server.log_text()
    # Aborted, not waited for: its 800 tokens did not all come before the end.
    assert rest and rest[-1] == "data: [DONE]", rest
    assert any('"error"' in line for line in rest), rest
    assert sum(line.startswith("data: {") for line in rest) < 800
    wait_session_gone(server)
    log = server.log_text()
    assert "engine core stopped" in log and "Traceback" not in log, log
