"""Images through the Responses API (input_image parts) and Anthropic's Messages API (image
blocks, base64 and url sources) on a real server of the tiny random-weight Idefics3, with the
official openai and anthropic clients: greedy, the text of /v1/chat/completions with the same
image (whose tokens equal transformers', tests/entrypoints/test_server_vision.py), streamed and
not; a second Responses turn over a stored image; bad images and too many images are 400s in
each API's shape naming its own field."""

import base64

import anthropic
import httpx
import pytest

from models.vlm_fixture import image
from server_utils import assert_error
from test_server_vision import (  # noqa: F401
    QUESTION,
    _data_url,
    _messages,
    _png,
    loopback,
    media_dir,
    start_vision_server,
    vlm_dir,
)

N = 6
MODEL = "vlm"
GREEDY = {"temperature": 0}  # the anthropic client of this version has no temperature argument
B64 = base64.b64encode(_png(image(5))).decode()


@pytest.fixture(scope="module")
def server(vlm_dir, media_dir):  # noqa: F811
    s = start_vision_server(vlm_dir, media_dir, env={"PAGEDLLM_ENABLE_RESPONSES_API_STORE": "1"})
    yield s
    s.close()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _chat(server, messages):
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


@pytest.fixture(scope="module")
def chat_text(server):
    """/v1/chat/completions' greedy answer about image(5); another image answers otherwise."""
    text, _ = _chat(server, _messages(_data_url(image(5))))
    assert text and text != _chat(server, _messages(_data_url(image(4))))[0]
    return text


def _input(url, text=QUESTION):
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": text},
                {"type": "input_image", "image_url": url, "detail": "auto"},
            ],
        }
    ]


def test_responses_input_image_is_chats(server, chat_text, media_dir, loopback):  # noqa: F811
    client = server.client()
    for url in (_data_url(image(5)), f"file://{media_dir}/cat.png", f"{loopback}/cat.png"):
        r = client.responses.create(model=MODEL, input=_input(url), max_output_tokens=N, temperature=0, store=False)
        assert r.output_text == chat_text, url
    events = list(
        client.responses.create(
            model=MODEL, input=_input(_data_url(image(5))), max_output_tokens=N, temperature=0, stream=True, store=False
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text


def test_responses_second_turn_over_a_stored_image(server, chat_text):
    """previous_response_id carries the image: turn 2 is chat's answer on the whole conversation."""
    client = server.client()
    first = client.responses.create(
        model=MODEL, input=_input(_data_url(image(5))), max_output_tokens=N, temperature=0, store=True
    )
    assert first.output_text == chat_text
    second = client.responses.create(
        model=MODEL,
        input="And the colours?",
        previous_response_id=first.id,
        max_output_tokens=N,
        temperature=0,
        store=False,
    )
    conversation = _messages(_data_url(image(5))) + [
        {"role": "assistant", "content": chat_text},
        {"role": "user", "content": "And the colours?"},
    ]
    text, prompt_tokens = _chat(server, conversation)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens


def _block(source):
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}]


def test_anthropic_image_blocks_are_chats(server, claude, chat_text, loopback):  # noqa: F811
    for source in (
        {"type": "base64", "media_type": "image/png", "data": B64},
        {"type": "url", "url": f"{loopback}/cat.png"},
    ):
        m = claude.messages.create(model=MODEL, max_tokens=N, messages=_block(source), extra_body=GREEDY)
        assert m.content[0].text == chat_text, source["type"]
    base64_source = {"type": "base64", "media_type": "image/png", "data": B64}
    with claude.messages.stream(model=MODEL, max_tokens=N, messages=_block(base64_source), extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == chat_text
    _, prompt_tokens = _chat(server, _messages(_data_url(image(5))))
    assert claude.messages.count_tokens(model=MODEL, messages=_block(base64_source)).input_tokens == prompt_tokens


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(input=_input("data:image/png;base64,@@@")), "input[0].content[1].image_url", "base64"),
        (dict(input=_input("ftp://example.com/a.png")), "input[0].content[1].image_url", "not supported"),
        (dict(input=_input("file:///etc/hostname")), "input[0].content[1].image_url", "--allowed-local-media-path"),
        (
            dict(
                instructions="Be brief.",  # the system message and the first item shift chat's index
                input=[
                    {"role": "user", "content": "hi"},
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
                ],
            ),
            "input[1].content[0].image_url",
            "not an image",
        ),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]),
            "input[0].content[0]",
            "file_id is not supported",
        ),
        (
            dict(
                input=[
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": _data_url(image(s))} for s in (1, 2, 3)],
                    }
                ]
            ),
            "input",
            "at most 2 image(s)",
        ),
    ],
)
def test_responses_bad_image_is_400(server, body, param, words):
    r = httpx.post(server.base_url + "/responses", json={"model": MODEL, "max_output_tokens": 2, **body}, timeout=60)
    err = assert_error(r, 400)
    assert err["param"] == param and err["message"].startswith(param) and words in err["message"], err


@pytest.mark.parametrize(
    "blocks, words",
    [
        (
            _block({"type": "base64", "media_type": "image/png", "data": "@@@"}),
            "messages[0].content[1].source.data: the data URL's base64 does not decode",
        ),
        (
            _block({"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"text").decode()}),
            "messages[0].content[1].source.data: the data is not an image",
        ),
        (
            _block({"type": "base64", "media_type": "text/plain", "data": B64}),
            "messages[0].content[1].source.media_type",
        ),
        (_block({"type": "url", "url": "ftp://example.com/a.png"}), "messages[0].content[1].source.url: URL scheme"),
        (_block({"type": "file", "file_id": "f"}), "messages[0].content[1].source.type 'file' is not supported"),
        (_block({"type": "base64", "media_type": "image/png", "data": B64}) * 3, "at most 2 image(s)"),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": _block({"type": "url", "url": "x"})[0]["content"]},
            ],
            "messages[1].content[1]: image blocks cannot be in assistant messages",
        ),
    ],
)
def test_anthropic_bad_image_is_400(server, blocks, words):
    body = {"model": MODEL, "max_tokens": 2, "messages": blocks, "system": "Be brief."}  # system: chat's index + 1
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"], err
