"""The chat endpoint's template options through a real server and the official openai client:
`add_generation_prompt: false`, `continue_final_message`, `chat_template_kwargs` (and the Responses
API's `reasoning.effort`, which becomes template variables), against prompt
token ids written out by hand for a template given as a file (`--chat-template FILE`), on the
tiny random model (its word-level tokenizer maps "w<id>" to id). The server takes its API key
from $PAGEDLLM_API_KEY: a request without it is a 401."""

import httpx
import openai
import pytest
from server_utils import TINY, RemoteServer, assert_error

TEMPLATE = (
    "{% for m in messages %}w100 {{ m['content'] }} w101 {% endfor %}"
    "{% if add_generation_prompt %}w102 {% endif %}{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if enable_thinking is defined %}{{ 'w300 ' if enable_thinking else 'w301 w301 w301 ' }}{% endif %}"
    "{% if reasoning_effort is defined %}{{ {'none': 'w310', 'low': 'w311 w311', 'high': 'w313 w313 w313 w313'}"
    "[reasoning_effort] }}{% endif %}"
)
KEY = "sk-from-the-environment"
USER = [{"role": "user", "content": "w77 w8"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = RemoteServer(
        ["--model", TINY, "--max-model-len", "64", "--kv-cache-memory", "0.01", "--chat-template", str(template)],
        env={"PAGEDLLM_API_KEY": KEY},
    )
    srv.api_key = KEY  # the tests' client and headers send it
    yield srv
    srv.close()


def _prompt_ids(client, messages, **extra) -> list[int]:
    """The prompt's token ids as the server saw them: its prompt logprobs (vLLM's: None for the
    first token, then {id: ...} with the prompt's own token) and usage's count."""
    r = client.chat.completions.create(
        model=TINY, messages=messages, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0, **extra}
    )
    plps = r.model_extra["prompt_logprobs"]
    assert plps[0] is None and all(len(p) == 1 for p in plps[1:]), plps
    ids = [int(next(iter(p))) for p in plps[1:]]
    assert r.usage.prompt_tokens == len(ids) + 1
    return ids


@pytest.mark.timeout(300)  # the first to run starts the server
@pytest.mark.parametrize(
    "messages, extra, expected",
    [
        (USER, {}, [100, 77, 8, 101, 102]),
        (USER, {"add_generation_prompt": False}, [100, 77, 8, 101]),
        (
            USER + [{"role": "assistant", "content": "w55 w56"}],
            {"continue_final_message": True, "add_generation_prompt": False},
            [100, 77, 8, 101, 100, 55, 56],
        ),
        (USER, {"chat_template_kwargs": {"greeting": "w200 w201"}}, [100, 77, 8, 101, 102, 200, 201]),
    ],
)
def test_template_options(client, messages, extra, expected):
    assert expected[0] == 100  # the first token has no logprob: the template starts with it
    assert _prompt_ids(client, messages, **extra) == expected[1:]


@pytest.mark.timeout(300)
def test_api_key_from_the_environment(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1}, timeout=30)
    assert_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [TINY]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "effort, expected",
    [(None, []), ("none", [301, 301, 301, 310]), ("low", [300, 311, 311]), ("high", [300, 313, 313, 313, 313])],
)
def test_responses_reasoning_effort(client, effort, expected):
    """The Responses API's reasoning.effort reaches the template as vLLM passes it: enable_thinking
    (off for "none") and reasoning_effort. Each effort gives the prompt another length (usage);
    chat with those template variables gives these ids."""
    expected = [100, 77, 8, 101, 102] + expected
    kw = {} if effort is None else {"reasoning": {"effort": effort}}
    r = client.responses.create(model=TINY, input="w77 w8", max_output_tokens=1, temperature=0, **kw)
    assert r.usage.input_tokens == len(expected)
    assert (r.reasoning.effort if r.reasoning else None) == effort
    if effort is not None:
        template_kwargs = {"enable_thinking": effort != "none", "reasoning_effort": effort}
        assert _prompt_ids(client, USER, chat_template_kwargs=template_kwargs) == expected[1:]
