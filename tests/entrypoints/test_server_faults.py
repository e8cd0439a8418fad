"""The server under faults: a wrong or missing API key (401), overload past
--max-waiting-requests (503 at once, the admitted requests finish), and a dead engine core
(the stream in flight ends with an error, no hang, and the server exits 1 leaving no process;
more in test_server_engine_failure.py). One small server
(one sequence at a time, one waiting at most), stopped by the last test."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import openai
import pytest

from server_utils import RemoteServer, assert_error, wait_metrics, wait_session_gone

pytestmark = pytest.mark.model

KEY = "sk-pagedllm-test"
MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer(
        [
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "0.05",
            "--max-num-seqs",
            "1",
            "--max-waiting-requests",
            "1",
            "--chat-template",
            TEMPLATE,
            "--served-model-name",
            "my-model",
            MODEL,
        ],
        api_key=KEY,
    )
    yield srv
    srv.close()


@pytest.mark.timeout(60)
def test_api_key(server):
    url = server.base_url + "/models"
    assert_error(httpx.get(url), 401, "invalid_api_key")
    assert_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    assert_error(httpx.post(server.base_url + "/completions", json={"prompt": "hi"}), 401, "invalid_api_key")
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "hi"}), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.client().models.list().data] == ["my-model", MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # monitoring needs no key
    assert httpx.get(server.url + "/metrics").status_code == 200
    r = server.client().completions.create(model="my-model", prompt="Hi", max_tokens=2)
    assert r.model == "my-model" and r.usage.completion_tokens <= 2


@pytest.mark.timeout(60)
def test_chat_template_flag(server, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers=server.headers())
    assert r.json()["tokens"] == tokenizer("user: Hi\nassistant:")["input_ids"]
    r = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(tokenizer("user: Hi\nassistant:")["input_ids"])


@pytest.mark.timeout(300)
def test_overload_503_at_once_admitted_finish(server):
    """A runs (max_num_seqs=1), B waits (the one waiting place), C is refused at once: while A
    and B are still in flight, seen through events, not a clock. A asks for far more tokens
    than the checks need, so it surely outlasts them; then its client goes away and B runs."""
    client = server.client()
    results = {}

    def run_b():
        try:
            results["B"] = client.completions.create(
                model="my-model", prompt="Request B:", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
            )
        except Exception as e:  # noqa: BLE001 - reported by the asserts below
            results["B"] = e

    body = {"model": "my-model", "prompt": "Request A:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=server.headers(), timeout=60) as a:
        assert a.status_code == 200
        wait_metrics(server, lambda m: m["pagedllm:num_requests_running"] == 1, "A runs")
        b = threading.Thread(target=run_b)
        b.start()
        wait_metrics(server, lambda m: m["pagedllm:num_requests_waiting"] == 1, "B waits")
        r = httpx.post(
            server.base_url + "/completions",
            headers=server.headers(),
            json={"model": "my-model", "prompt": "C", "max_tokens": 4},
            timeout=60,
        )
        err = assert_error(r, 503, "server_overloaded")
        assert "max-waiting-requests" in err["message"]
        with pytest.raises(openai.InternalServerError):  # 503 through the client too (no retries)
            client.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "C"}], max_tokens=2)
        # Refused while A and B were still in flight: not queued behind them.
        m = server.metrics()
        assert m["pagedllm:num_requests_running"] == 1 and m["pagedllm:num_requests_waiting"] == 1, m
        assert "B" not in results
    b.join(120)
    assert not b.is_alive(), "B did not finish after A's client went away"
    assert not isinstance(results["B"], Exception), results["B"]
    assert results["B"].usage.completion_tokens == 4 and results["B"].choices[0].finish_reason == "length"
    m = server.metrics()
    assert m['pagedllm:request_rejected_total{reason="overloaded"}'] >= 2
    # and afterwards the server takes requests again
    assert client.completions.create(model="my-model", prompt="again", max_tokens=2).choices


@pytest.mark.timeout(120)
def test_core_death_503_and_clean_exit(server):
    core = server.core_pid()
    body = {"model": "my-model", "prompt": "Count slowly:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=server.headers(), timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        os.kill(core, signal.SIGKILL)
        rest = [line for line in lines if line]  # the stream ends (a hang: the read timeout above)
    assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest), rest
    # The server exits 1 by itself, for a supervisor to restart it.
    assert server.proc.wait(30) == 1
    assert "engine core process died" in server.log_text()
    wait_session_gone(server)
