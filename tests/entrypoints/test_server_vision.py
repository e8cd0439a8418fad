"""Images through the OpenAI server: image_url parts (data:, file:// under
--allowed-local-media-path, http(s) from a loopback server) with the official openai client on
a tiny random-weight Idefics3, streamed and not, give the tokens of offline LLM.chat (itself
transformers' on the same prompt); bad images, too many images and a text-only model get 400s
naming the part, and do not disturb a good request beside them; the encoder cache's counters
(vLLM's mm_cache_queries / mm_cache_hits) on /metrics."""

import asyncio
import base64
import http.server
import io
import threading

import httpx
import pytest

from models.vlm_fixture import SMOLVLM_TEMPLATE, build_tiny_idefics3, hf_greedy, image
from server_utils import RemoteServer, assert_error, wait_idle, wait_metrics

N = 6
MODEL = "vlm"
QUESTION = "What is in this picture?"
GREEDY = dict(max_tokens=N, temperature=0, extra_body={"ignore_eos": True})


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


def _messages(*urls, text=QUESTION):
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(_png(image(5)))
    (d / "broken.png").write_bytes(b"\x89PNG not really")
    return d


def start_vision_server(vlm_dir, media_dir, env=None) -> RemoteServer:
    """The tiny VLM served with two images a prompt and file:// URLs under media_dir."""
    return RemoteServer(
        [
            "--model",
            vlm_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "0.01",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-local-media-path",
            str(media_dir),
            "--served-model-name",
            MODEL,
        ],
        env=env,
    )


@pytest.fixture(scope="module")
def server(vlm_dir, media_dir):
    s = start_vision_server(vlm_dir, media_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(vlm_dir):
    """LLM.chat's output for the question about image(5), and transformers' tokens for its prompt."""
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(vlm_dir, dtype="float32")
    out = llm.chat(
        _messages(_data_url(image(5))), SamplingParams(max_tokens=N, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    prompt = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": QUESTION + "\n<image>"}], add_generation_prompt=True, tokenize=False
    )
    assert list(out.token_ids) == hf_greedy(vlm_dir, prompt, [image(5)], N)
    return out.text


@pytest.fixture(scope="module")
def loopback(media_dir):
    """An http server on 127.0.0.1 serving media_dir; -> its base URL."""
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(media_dir)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_image_url_gives_offline_tokens(server, offline, media_dir, loopback):
    """The same image as a data URL, a file:// URL under the allowed folder and an http URL: the
    text of offline LLM.chat, streamed and not."""
    client = server.client()
    for url in (_data_url(image(5)), f"file://{media_dir}/cat.png", f"{loopback}/cat.png"):
        r = client.chat.completions.create(model=MODEL, messages=_messages(url), **GREEDY)
        assert r.choices[0].message.content == offline, url
        assert r.usage.completion_tokens == N
    stream = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image(5))), stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == offline
    other = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image(4))), **GREEDY)
    assert other.choices[0].message.content != offline  # the image decides the answer


def _post(server, messages):
    return httpx.post(server.base_url + "/chat/completions", timeout=60, json={"messages": messages, "max_tokens": 2})


@pytest.mark.parametrize(
    "url, param, words",
    [
        ("data:image/png;base64,@@@notbase64", "messages[0].content[1].image_url.url", "base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"plain text").decode(),
            "messages[0].content[1].image_url.url",
            "not an image",
        ),
        ("data:text/plain,hello", "messages[0].content[1].image_url.url", "data:image/"),
        ("ftp://example.com/a.png", "messages[0].content[1].image_url.url", "not supported"),
        ("file:///etc/hostname", "messages[0].content[1].image_url.url", "outside --allowed-local-media-path"),
        ("BROKEN", "messages[0].content[1].image_url.url", "not an image"),
        ("MISSING", "messages[0].content[1].image_url.url", "HTTP 404"),
    ],
)
def test_bad_image_is_400_naming_the_part(server, media_dir, loopback, url, param, words):
    url = {"BROKEN": f"file://{media_dir}/broken.png", "MISSING": f"{loopback}/missing.png"}.get(url, url)
    err = assert_error(_post(server, _messages(url)), 400)
    assert err["param"] == param and words in err["message"], err


def test_too_many_images_is_400(server):
    err = assert_error(_post(server, _messages(*[_data_url(image(s)) for s in (1, 2, 3)])), 400)
    assert err["param"] == "messages" and "at most 2 image(s)" in err["message"], err


def test_text_only_model_refuses_images(tiny_shared_server):
    err = assert_error(_post(tiny_shared_server, _messages(_data_url(image(1)))), 400)
    assert err["param"] == "messages[0].content[1]" and "vision-language model" in err["message"], err


def test_bad_request_beside_good_ones(server, offline):
    """Bad images sent at the same time as good requests: the good ones get their answer."""
    client = server.async_client()

    async def good():
        r = await client.chat.completions.create(model=MODEL, messages=_messages(_data_url(image(5))), **GREEDY)
        return r.choices[0].message.content

    async def bad():
        import openai

        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL, messages=_messages("data:image/png;base64,AAAA"), **GREEDY
            )

    async def run():
        return await asyncio.gather(good(), bad(), good(), bad())

    results = asyncio.run(run())
    assert results[0] == results[2] == offline


def test_encoder_cache_metrics(server):
    """One prompt with the same image twice: two queries, the second a hit (no second encoder run)."""
    q, h = "pagedllm:mm_cache_queries_total", "pagedllm:mm_cache_hits_total"
    before = wait_idle(server)
    url = _data_url(image(9))
    server.client().chat.completions.create(model=MODEL, messages=_messages(url, url), **GREEDY)
    after = wait_metrics(server, lambda m: m[q] > before[q], "the encoder cache's queries")
    assert (after[q] - before[q], after[h] - before[h]) == (2, 1)


def test_template_that_takes_parts(vlm_dir, tmp_path):
    """--chat-template with SmolVLM's own template (it iterates over content parts): the server
    gives the text of LLM.chat with the same template (whose tokens equal transformers', see
    tests/models/test_idefics3.py)."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    template = tmp_path / "smolvlm.jinja"
    template.write_text(SMOLVLM_TEMPLATE)
    messages = _messages(_data_url(image(6)))
    llm = LLM(vlm_dir, dtype="float32")
    ref = llm.chat(
        messages,
        SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
        use_tqdm=False,
        chat_template=SMOLVLM_TEMPLATE,
    )[0]
    assert "<image>" in ref.prompt and "'type'" not in ref.prompt
    s = RemoteServer(
        [
            "--model",
            vlm_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "0.01",
            "--served-model-name",
            MODEL,
            "--chat-template",
            str(template),
        ]
    )
    try:
        r = s.client().chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    finally:
        s.close()
