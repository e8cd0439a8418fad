"""Two per-request behaviours of the engine through a real server (the openai client): the model's
generation_config.json sampling defaults (--generation-config auto) apply to the fields a request
leaves unset, and a request's own values override them, in completions and chat; and the
`priority` field reaches the scheduler (--scheduling-policy priority takes it, an FCFS server
refuses a nonzero one with a 400 naming it). Expected texts come from the offline LLM on the
same folder (top_k 1 makes the defaults an argmax, so they are deterministic)."""

import httpx
import pytest

from model_dirs import with_generation_config
from pagedllm import LLM, SamplingParams
from server_utils import TINY, TINY_CHAT_TEMPLATE, assert_error, tiny_server

DEFAULTS = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.5}
PROMPT = [5, 6, 7, 5, 6, 7]
MESSAGES = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7"}]
MAX_TOKENS = 12
OVERRIDE = {"temperature": 0.0, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_generation_config(TINY, str(tmp_path_factory.mktemp("gen") / "tiny"), DEFAULTS)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = tiny_server(64, "--model", model_dir, "--scheduling-policy", "priority", "--max-num-seqs", "2")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, max_model_len=64)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=MAX_TOKENS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    text = lambda outs: outs[0].outputs[0].text  # noqa: E731
    prompt = [{"prompt_token_ids": PROMPT}]
    return {
        "penalised": text(llm.generate(prompt, penalised, use_tqdm=False)),
        "greedy": text(llm.generate(prompt, greedy, use_tqdm=False)),
        "chat penalised": text(llm.chat(MESSAGES, penalised, use_tqdm=False, chat_template=TINY_CHAT_TEMPLATE)),
        "chat greedy": text(llm.chat(MESSAGES, greedy, use_tqdm=False, chat_template=TINY_CHAT_TEMPLATE)),
    }


def model(server) -> str:
    return server.client().models.list().data[0].id


@pytest.mark.parametrize("extra, want", [({}, "penalised"), (OVERRIDE, "greedy")])
def test_completions_take_the_model_defaults_unless_set(server, offline, extra, want):
    assert offline["penalised"] != offline["greedy"]  # the penalty shows on this prompt
    out = server.client().completions.create(
        model=model(server), prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=extra or None
    )
    assert out.choices[0].text == offline[want]


@pytest.mark.parametrize("extra, want", [({}, "chat penalised"), (OVERRIDE, "chat greedy")])
def test_chat_takes_the_model_defaults_unless_set(server, offline, extra, want):
    assert offline["chat penalised"] != offline["chat greedy"]
    out = server.client().chat.completions.create(
        model=model(server), messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body=extra or None
    )
    assert out.choices[0].message.content == offline[want]


def test_a_priority_is_taken_by_the_priority_server(server, offline):
    for priority in (-3, 0, 7):
        out = server.client().completions.create(
            model=model(server), prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"priority": priority}
        )
        assert out.choices[0].text == offline["penalised"]
    r = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "priority": 1.5}, timeout=60)
    assert "priority" in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    "path, body", [("/completions", {"prompt": PROMPT}), ("/chat/completions", {"messages": MESSAGES})]
)
def test_an_fcfs_server_refuses_a_priority(tiny_shared_server, path, body):
    r = httpx.post(tiny_shared_server.base_url + path, json={**body, "max_tokens": 2, "priority": 2}, timeout=60)
    assert "priority 2 needs --scheduling-policy priority" in assert_error(r, 400)["message"]
