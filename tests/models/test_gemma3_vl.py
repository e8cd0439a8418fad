"""Gemma 3 with its vision tower against transformers' own Gemma3ForConditionalGeneration on a
tiny random-weight checkpoint: greedy tokens with one and two images in a batch with a text-only
prompt, with a token budget of one image (each
image prefilled whole in its step), with preemption by recompute, and after a prefix-cache hit
that ends inside an image. The bidirectional block mask among an image's tokens decides the
tokens (transformers without it gives others)."""

import pytest

from pagedllm.entrypoints.llm import LLM
from models.gemma3v_fixture import IMAGE, IMAGE_TOKENS, build_tiny_gemma3v, hf_greedy
from models.vlm_fixture import generate_checked, greedy, image, mm_prompt

ONE, TWO = f"Look at {IMAGE} and say what you see", f"Compare {IMAGE} with {IMAGE} now, please"
TEXT, N = "The capital of France is", 6


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_gemma3v(str(tmp_path_factory.mktemp("gemma3v")))


@pytest.fixture(scope="module")
def refs(vlm_dir):
    return [hf_greedy(vlm_dir, t, imgs, N) for t, imgs in _cases()]


def _cases():
    return [(ONE, [image(1)]), (TWO, [image(2), image(3, (40, 64))]), (TEXT, [])]


def test_the_image_and_its_mask_decide_the_tokens(vlm_dir, refs):
    assert refs[0] != hf_greedy(vlm_dir, ONE, [image(4)], N)
    assert refs[:2] != [hf_greedy(vlm_dir, t, imgs, N, bidirectional=False) for t, imgs in _cases()[:2]]


@pytest.mark.parametrize("budget", [2048, IMAGE_TOKENS])
def test_greedy_matches_transformers(vlm_dir, refs, budget):
    """A budget of one image's tokens: the prompts are prefilled in chunks, none ends inside an
    image (the runner refuses a step that would split one)."""
    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    generate_checked(llm, _cases(), refs, N)


def test_preemption(vlm_dir):
    """A KV cache too small for the three image prompts at once: preempted requests are
    recomputed, their images' tokens again bidirectional, with transformers' tokens."""
    prompts = [(TWO, [image(s), image(s + 1)]) for s in (1, 4, 6)]
    refs = [hf_greedy(vlm_dir, t, imgs, 40) for t, imgs in prompts]
    llm = LLM(
        vlm_dir,
        dtype="float32",
        num_gpu_blocks=28,
        block_size=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    outs = llm.generate([mm_prompt(t, imgs) for t, imgs in prompts], greedy(40), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert llm.llm_engine.num_preemptions > 0


def test_prefix_hit_inside_an_image(vlm_dir):
    """The same prompt again, with blocks of 8: the cached blocks end inside the image, the rest
    of its tokens attend to the cached ones and to each other, as transformers does."""
    text = f"Look at {IMAGE}"
    llm = LLM(vlm_dir, dtype="float32", enable_prefix_caching=True, block_size=8)
    prompt_ids = llm.llm_engine.processor.process_images(mm_prompt(text, [image(1)])).token_ids
    first = prompt_ids.index(llm.llm_engine.processor.load_mm_processor().soft_token_id)
    hit = (len(prompt_ids) - 1) // 8 * 8
    assert first < hit < first + IMAGE_TOKENS  # the prompt is such that the hit ends inside the image
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    ref = hf_greedy(vlm_dir, text, [image(1)], N)
    assert list(llm.generate(mm_prompt(text, [image(1)]), greedy(N), use_tqdm=False)[0].outputs[0].token_ids) == ref
    hits = kv.stats.hits
    assert list(llm.generate(mm_prompt(text, [image(1)]), greedy(N), use_tqdm=False)[0].outputs[0].token_ids) == ref
    assert kv.stats.hits - hits == hit


def test_budget_below_an_image_is_refused(vlm_dir):
    with pytest.raises(ValueError, match=f"max_num_batched_tokens \\(8\\) must be >= {IMAGE_TOKENS}"):
        LLM(vlm_dir, dtype="float32", max_num_batched_tokens=8)
