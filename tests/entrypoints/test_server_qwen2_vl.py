"""Qwen2-VL through LLM.chat and the OpenAI server on a tiny random-weight checkpoint with
Qwen2-VL's own chat template: the chat's tokens are transformers' on the prompt its template
renders, and the server (official openai client, image_url as a data URL, streamed and not)
gives them too, with a token budget that splits the image across prefill steps (the M-RoPE table
kept between them), a repeat that hits the prefix cache, and text-only requests beside it."""

import asyncio

import pytest
from transformers import AutoTokenizer

from entrypoints.test_server_vision import _data_url, _messages
from models.qwen2vl_fixture import build_tiny_qwen2vl, hf_greedy
from models.vlm_fixture import SMOLLM2, image
from server_utils import RemoteServer, wait_idle, wait_metrics

N = 6
MODEL = "qwen2vl"
GREEDY = dict(max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
PICTURE = image(5, (120, 100))  # 6 x 6 patches: 9 image tokens


def _greedy():
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_qwen2vl(str(tmp_path_factory.mktemp("qwen2vl")))


@pytest.fixture(scope="module")
def offline(vlm_dir):
    """LLM.chat about PICTURE: transformers' tokens on the prompt Qwen2-VL's template renders for
    the same message (image part as {"type": "image"}), and LLM.generate's on that prompt."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=8)  # the image split across steps
    out = llm.chat(_messages(_data_url(PICTURE)), _greedy(), use_tqdm=False)[0]
    prompt = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.count("<|image_pad|>") == 1 and out.prompt.count("<|image_pad|>") == 9
    ref = hf_greedy(vlm_dir, prompt, [PICTURE], N)
    assert list(out.outputs[0].token_ids) == ref
    gen = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [PICTURE]}}, _greedy(), use_tqdm=False)[0]
    assert list(gen.outputs[0].token_ids) == ref
    return out


def test_string_content_template_wraps_the_image(vlm_dir, offline):
    """A template that prints string contents (SmolLM2's): the image part becomes Qwen2-VL's
    <|vision_start|><|image_pad|><|vision_end|>, and the tokens are transformers' on that text."""
    from pagedllm.entrypoints.llm import LLM

    template = AutoTokenizer.from_pretrained(SMOLLM2).chat_template
    out = LLM(vlm_dir, dtype="float32").chat(
        _messages(_data_url(PICTURE)), _greedy(), use_tqdm=False, chat_template=template
    )[0]
    prompt = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": "What is in this picture?\n<|vision_start|><|image_pad|><|vision_end|>"}],
        add_generation_prompt=True,
        tokenize=False,
        chat_template=template,
    )
    assert list(out.outputs[0].token_ids) == hf_greedy(vlm_dir, prompt, [PICTURE], N)


def streamed_text(client, model: str, messages: list) -> str:
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def image_chats_beside_text(s: RemoteServer, model: str, messages: list) -> list[str]:
    """The chat `messages` sent twice at once with two text-only chats, greedy: its two answers."""
    aclient = s.async_client()

    async def chat(msgs):
        r = await aclient.chat.completions.create(model=model, messages=msgs, **GREEDY)
        return r.choices[0].message.content

    async def run():
        text = [[{"role": "user", "content": f"Count to {i}"}] for i in (3, 5)]
        return await asyncio.gather(*(chat(m) for m in (text[0], messages, text[1], messages)))

    return asyncio.run(run())[1::2]


def test_server_gives_offline_tokens(vlm_dir, offline):
    """Streamed and not, a repeat that hits the prefix cache, and text-only chats at the same
    time: the image chat's text and prompt length are LLM.chat's every time."""
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
            "--max-num-batched-tokens",
            "8",
            "--block-size",
            "4",
            "--served-model-name",
            MODEL,
        ]
    )
    try:
        client = s.client()
        messages = _messages(_data_url(PICTURE))
        r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        assert r.choices[0].message.content == offline.outputs[0].text
        assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
        before = wait_idle(s)
        assert streamed_text(client, MODEL, messages) == offline.outputs[0].text
        hits = "pagedllm:prefix_cache_hits_total"
        after = wait_metrics(s, lambda m: m[hits] > before[hits], "the repeat's prefix-cache hits")
        assert after[hits] - before[hits] >= 4 * (len(offline.prompt_token_ids) // 4 - 1)  # all but the last block
        assert image_chats_beside_text(s, MODEL, messages) == [offline.outputs[0].text] * 2
    finally:
        s.close()
