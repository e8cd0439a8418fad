"""Gemma 3 with its vision tower through LLM.chat and the OpenAI server on a tiny random-weight
checkpoint with Gemma 3's own chat template (an image part becomes <start_of_image>, which the
processor expands to the image's soft tokens): the chat's tokens are transformers' on the prompt
the template renders, and the server (official openai client, image_url as a data URL, streamed
and not) gives them too, with a token budget of one image (each image prefilled whole in its
step) and text-only requests beside it."""

import pytest
from transformers import AutoTokenizer

from entrypoints.test_server_qwen2_vl import GREEDY, N, _greedy, image_chats_beside_text, streamed_text
from entrypoints.test_server_vision import _data_url, _messages
from models.gemma3v_fixture import IMAGE, IMAGE_TOKENS, build_tiny_gemma3v, hf_greedy
from models.vlm_fixture import image
from server_utils import RemoteServer

MODEL = "gemma3v"
PICTURE = image(5, (120, 100))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_gemma3v(str(tmp_path_factory.mktemp("gemma3v")))


@pytest.fixture(scope="module")
def chat(vlm_dir):
    """-> (LLM.chat's output about PICTURE, the LLM, the prompt Gemma 3's template renders for the
    same message with the image part as {"type": "image"})."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=IMAGE_TOKENS)
    out = llm.chat(_messages(_data_url(PICTURE)), _greedy(), use_tqdm=False)[0]
    prompt = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return out, llm, prompt


def test_chat_gives_transformers_tokens(vlm_dir, chat):
    """The template places <start_of_image> (the processor expands it to the soft tokens); the
    chat's tokens, and LLM.generate's on the rendered prompt, are transformers'."""
    out, llm, prompt = chat
    assert prompt.count(IMAGE) == 1 and prompt.endswith("<start_of_turn>model\n")
    assert out.prompt.count("<image_soft_token>") == IMAGE_TOKENS
    ref = hf_greedy(vlm_dir, prompt, [PICTURE], N)
    assert list(out.outputs[0].token_ids) == ref
    gen = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [PICTURE]}}, _greedy(), use_tqdm=False)[0]
    assert list(gen.outputs[0].token_ids) == ref


def test_server_gives_offline_tokens(vlm_dir, chat):
    """Streamed and not, and text-only chats at the same time: the image chat's text and prompt
    length are LLM.chat's every time."""
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
            str(IMAGE_TOKENS),
            "--block-size",
            "4",
            "--served-model-name",
            MODEL,
        ]
    )
    offline = chat[0]
    try:
        client = s.client()
        messages = _messages(_data_url(PICTURE))
        r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        assert (r.choices[0].message.content, r.usage.prompt_tokens) == (
            offline.outputs[0].text,
            len(offline.prompt_token_ids),
        )
        assert streamed_text(client, MODEL, messages) == offline.outputs[0].text
        assert image_chats_beside_text(s, MODEL, messages) == [offline.outputs[0].text] * 2
    finally:
        s.close()
