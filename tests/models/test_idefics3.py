"""Idefics3 / SmolVLM against transformers' own Idefics3ForConditionalGeneration on a tiny
random-weight checkpoint: greedy tokens with one and two images, an image split across
chunked-prefill steps, a batch mixed with text-only prompts, preemption by recompute, LLM.chat
with image parts; and the prefix cache keyed by the
images' content hashes (a repeated image + prompt runs no encoder, another image gets no hit)."""

import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
from models.vlm_fixture import IMAGE_TOKENS, SMOLVLM_TEMPLATE, build_tiny_idefics3, generate_checked, hf_greedy, image

ONE = "Look <image> and say what you see in this picture, please, in one line"
TWO = "Compare <image> with <image> now"
TEXT = "The capital of France is"
N = 6


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")))


def _greedy():
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def _runner(llm):
    return llm.llm_engine.core.model_executor.driver_worker.model_runner


def _cases():
    return [(ONE, [image(1)]), (TWO, [image(2), image(3, (64, 40))]), (TEXT, [])]


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.mark.parametrize("budget", [2048, IMAGE_TOKENS // 2])
def test_greedy_matches_transformers(vlm_dir, budget):
    """One image, two images and a text-only prompt in one batch; budget below an image's token
    count splits each image across prefill steps (the encoder cache holds it between them)."""
    refs = [hf_greedy(vlm_dir, t, imgs, N) for t, imgs in _cases()]
    assert refs[0] != hf_greedy(vlm_dir, ONE, [image(4)], N)  # the image decides the tokens
    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    generate_checked(llm, _cases(), refs, N)


def test_prefix_cache_keys_blocks_with_image_hashes(vlm_dir):
    llm = LLM(vlm_dir, dtype="float32", enable_prefix_caching=True)
    kv, cache = llm.llm_engine.core.scheduler.kv_cache_manager, _runner(llm).encoder_cache
    first = llm.generate(_prompt(ONE, [image(1)]), _greedy(), use_tqdm=False)
    hits = kv.stats.hits
    again = llm.generate(_prompt(ONE, [image(1)]), _greedy(), use_tqdm=False)
    assert kv.stats.hits - hits >= 32  # the blocks over the image are reused ...
    assert cache.images_encoded == 1  # ... and the encoder does not run again
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    hits = kv.stats.hits
    other = llm.generate(_prompt(ONE, [image(4)]), _greedy(), use_tqdm=False)
    # The image starts inside block 0, so every block keys on it: nothing is shared.
    assert kv.stats.hits == hits
    assert cache.images_encoded == 2
    assert list(other[0].outputs[0].token_ids) == hf_greedy(vlm_dir, ONE, [image(4)], N)


def test_bad_image_inputs(vlm_dir):
    llm = LLM(vlm_dir, dtype="float32")
    with pytest.raises(ValueError, match="placeholders for 2 images"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": [image(1), image(2)]}}, _greedy())
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] must be a PIL"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, _greedy())


def test_chat_with_image_parts(vlm_dir):
    """LLM.chat: an image part becomes the placeholder in the template's text where it stands
    (the parts joined by newlines), as a user who writes <image> into the message would get from
    transformers; an image_url part with a data: URL gives the same tokens."""
    import base64
    import io

    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": "What is in\n<image>\n?"}], add_generation_prompt=True, tokenize=False
    )
    ref = hf_greedy(vlm_dir, text, [image(5)], N)
    llm = LLM(vlm_dir, dtype="float32")
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in"},
                    {"type": "image_pil", "image_pil": image(5)},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    assert list(out[0].outputs[0].token_ids) == ref
    png = io.BytesIO()
    image(5).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in"},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    assert list(out[0].outputs[0].token_ids) == ref
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: type 'audio' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "audio"}, {"type": "image", "image": image(5)}]}])


def test_preemption_recomputes_images(vlm_dir):
    """A KV cache too small for all three image prompts at once: requests are preempted and
    recomputed (their images encoded again) and still give transformers' tokens."""
    prompts = [(ONE, [image(s)]) for s in (1, 4, 6)]
    refs = [hf_greedy(vlm_dir, t, imgs, 40) for t, imgs in prompts]
    # ~50 prompt tokens each: two fit at admission (4 blocks each), not as they grow to 6
    llm = LLM(vlm_dir, dtype="float32", num_gpu_blocks=9, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate([_prompt(t, imgs) for t, imgs in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert llm.llm_engine.num_preemptions > 0
    cache = _runner(llm).encoder_cache
    assert cache.images_encoded > 3 and cache.features == {} and cache.users == {}


def test_images_cross_to_the_core_process(vlm_dir):
    """AsyncLLM (the server's engine, the core in its own process): the images travel in the
    request message and give transformers' tokens; the message round-trips every field."""
    import asyncio

    import numpy as np

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.messages import AddRequests, EngineCoreRequest, decode_request, encode_request

    ref = hf_greedy(vlm_dir, TWO, [image(2), image(3, (64, 40))], N)

    async def run():
        engine = await AsyncLLM.create(EngineArgs(model=vlm_dir, dtype="float32"))
        try:
            _, request = engine.processor.process("r", _prompt(TWO, [image(2), image(3, (64, 40))]), _greedy())
            wire = AddRequests([EngineCoreRequest.from_request(request)])
            back = decode_request(encode_request(wire)).requests[0].to_request()
            for a, b in zip(request.mm_inputs, back.mm_inputs, strict=True):
                assert (a.offset, a.length, a.hash) == (b.offset, b.length, b.hash)
                np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
            tokens = []
            async for out in engine.generate(_prompt(TWO, [image(2), image(3, (64, 40))]), _greedy(), "x"):
                tokens += out.outputs[0].token_ids
            return tokens
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == ref


def test_second_chat_turn_does_not_reencode(vlm_dir):
    """Turn 2 of a chat about one image repeats turn 1's prompt: its blocks over the image hit
    the prefix cache, so the encoder does not run again."""
    llm = LLM(vlm_dir, dtype="float32", enable_prefix_caching=True)
    cache = _runner(llm).encoder_cache
    turn = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image(7)},
                {"type": "text", "text": "Describe this picture in a few words."},
            ],
        }
    ]
    answer = llm.chat(turn, _greedy(), use_tqdm=False)[0].outputs[0].text
    assert cache.images_encoded == 1
    turn2 = turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}]
    out = llm.chat(turn2, _greedy(), use_tqdm=False)[0]
    assert cache.images_encoded == 1 and out.num_cached_tokens >= 32


@pytest.mark.parametrize("budget", [2048, IMAGE_TOKENS // 2])
def test_same_image_twice_in_one_prompt(vlm_dir, budget):
    """One image shown twice: encoded once, held until the request's second copy is prefilled
    (also when the copies fall in different steps), transformers' tokens."""
    images = [image(2), image(2)]
    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    out = llm.generate(_prompt(TWO, images), _greedy(), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(vlm_dir, TWO, images, N)
    cache = _runner(llm).encoder_cache
    assert cache.images_encoded == 1 and cache.features == {} and cache.users == {}
    assert cache.take_step_stats() == (0, 0)  # taken by every step: (2 queries, 1 hit) went to the scheduler
    assert (llm.llm_engine.core.scheduler.mm_cache_queries, llm.llm_engine.core.scheduler.mm_cache_hits) == (2, 1)


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3_split")), do_image_splitting=True)


@pytest.mark.parametrize("budget", [2048, IMAGE_TOKENS // 2])
def test_split_images_match_transformers(split_dir, budget):
    """do_image_splitting (SmolVLM's default): each image is 2 x 2 tiles and the whole image, its
    placeholder tokens runs with a row / column tag between them; greedy equals transformers, also
    with each image split across prefill steps."""
    cases = [(ONE, [image(1, (150, 100))]), (TWO, [image(2), image(3, (64, 40))]), (TEXT, [])]
    refs = [hf_greedy(split_dir, t, imgs, N) for t, imgs in cases]
    llm = LLM(split_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    _, request = llm.llm_engine.processor.process("probe", _prompt(*cases[0]), _greedy())
    (img,) = request.mm_inputs
    assert img.pixel_values.shape[0] == 5 and len(img.runs) == 5  # 4 tiles + the whole image
    from pagedllm.engine.messages import AddRequests, EngineCoreRequest, decode_request, encode_request

    back = decode_request(encode_request(AddRequests([EngineCoreRequest.from_request(request)])))
    assert back.requests[0].to_request().mm_inputs[0].runs == img.runs  # as the core process gets it
    outs = llm.generate([_prompt(t, imgs) for t, imgs in cases], _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    cache = _runner(llm).encoder_cache
    assert cache.images_encoded == 3 and cache.features == {} and cache.users == {}


def test_chat_with_a_template_that_takes_parts(vlm_dir):
    """A template that iterates over content parts (SmolVLM's) gets the parts, the images as
    {"type": "image"}, and earlier string contents as text parts: the prompt transformers' own
    processor renders for the same messages."""
    from transformers import AutoProcessor

    from pagedllm.multimodal.chat import template_takes_parts

    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
    ]
    text = AutoProcessor.from_pretrained(vlm_dir).apply_chat_template(
        hf_messages, chat_template=SMOLVLM_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert text.count("<image>") == 2 and "'type'" not in text
    ref = hf_greedy(vlm_dir, text, [image(5), image(6)], N)
    llm = LLM(vlm_dir, dtype="float32")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": image(5)}, {"type": "text", "text": "Describe it."}],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image", "image": image(6)}]},
    ]
    out = llm.chat(messages, _greedy(), use_tqdm=False, chat_template=SMOLVLM_TEMPLATE)
    assert list(out[0].outputs[0].token_ids) == ref
    tok = llm.get_tokenizer()
    assert template_takes_parts(lambda m: tok.apply_chat_template(m, chat_template=SMOLVLM_TEMPLATE, tokenize=False))
    assert not template_takes_parts(lambda m: tok.apply_chat_template(m, tokenize=False))  # SmolLM2's ChatML
