"""A seeded fuzz of the image path on the tiny Idefics3, Qwen2.5-VL (M-RoPE positions kept
through chunks) and Gemma 3 (each image's tokens bidirectional, prefilled in one step; prefix
hits that end inside an image), with prefix hits, preemption and aborts: a random mix of requests with none, one
or two images (drawn from a small pool, so images repeat within and across prompts), arriving at
random steps, some aborted, under a random token budget (images split across steps), a small KV
cache (preemption) and prefix caching on or off. After each case: no block in use, the free
queue holds every block, the encoder cache holds nothing, and every request that finished gives
the greedy tokens of the same prompts run together on a roomy engine (itself equal to
transformers in test_idefics3.py)."""

import random
from typing import NamedTuple

import pytest

from models import gemma3v_fixture
from models.qwen2vl_fixture import IMAGE, build_tiny_qwen2vl
from models.vlm_fixture import build_tiny_idefics3, image
from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Look <image> and say",
    "Compare <image> with <image> now",
    "The capital of France is",
    "<image> what is this",
    "Tell me about <image> and then <image> please",
]


class Vlm(NamedTuple):
    path: str
    placeholder: str  # the text a prompt writes for one image
    min_budget: int = 1  # Gemma 3 prefills an image in one step: its budget holds one image's tokens
    kv_groups: int = 1  # KV-cache groups (Gemma 3: one full, two sliding): the blocks scale with them


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl", "gemma3"])
def vlm(tmp_path_factory, request) -> Vlm:
    path = str(tmp_path_factory.mktemp(f"{request.param}_fuzz"))
    if request.param == "idefics3":
        return Vlm(build_tiny_idefics3(path), "<image>")
    if request.param == "gemma3":
        return Vlm(gemma3v_fixture.build_tiny_gemma3v(path), gemma3v_fixture.IMAGE, gemma3v_fixture.IMAGE_TOKENS, 3)
    return Vlm(build_tiny_qwen2vl(path, qwen2_5=True), IMAGE)


@pytest.fixture(scope="module")
def roomy(vlm):
    return LLM(vlm.path, dtype="float32", enable_prefix_caching=False)


def _draw(rng: random.Random, k: int, placeholder: str) -> list[tuple[dict | str, SamplingParams, int, int]]:
    """(prompt, params, arrival step, abort step or -1) of k requests; placeholder: the model's
    text for one image."""
    pool = [image(s) for s in (1, 2, 3)]
    out = []
    for _ in range(k):
        text = rng.choice(TEXTS).replace("<image>", placeholder)
        images = [rng.choice(pool) for _ in range(text.count(placeholder))]
        prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0, ignore_eos=True)
        out.append((prompt, params, rng.randint(0, 3), rng.randint(1, 10) if rng.random() < 0.2 else -1))
    return out


# seeds 7 and 10 draw the smallest token budget (images split across steps; Gemma 3: one image a step)
@pytest.mark.parametrize("seed", [*range(6), 7, 10])
def test_image_workload_fuzz(vlm, roomy, seed):
    rng = random.Random(f"vlm-{seed}")
    llm = LLM(
        vlm.path,
        dtype="float32",
        max_num_batched_tokens=max(rng.choice([8, 24, 64, 2048]), vlm.min_budget),
        num_gpu_blocks=rng.choice([8, 10, 64]) * vlm.kv_groups,
        enable_prefix_caching=rng.random() < 0.7,
    )
    engine = llm.llm_engine
    requests = _draw(rng, rng.randint(3, 7), vlm.placeholder)
    done, step = {}, 0
    while step < 400 and (step <= 10 or engine.has_unfinished_requests()):
        for i, (prompt, params, arrive, abort) in enumerate(requests):
            if arrive == step:
                engine.add_request(f"r{i}", prompt, params, kind=OutputKind.FINAL_ONLY)
            if abort == step:
                engine.abort_request([f"r{i}"])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert not engine.has_unfinished_requests(), f"seed {seed}: unfinished after {step} steps"
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, f"seed {seed}: blocks in use"
    cache = engine.core.model_executor.driver_worker.model_runner.encoder_cache
    assert cache.features == {} and cache.users == {}, f"seed {seed}: encoder cache entries left"
    kept = [i for i in range(len(requests)) if f"r{i}" in done and done[f"r{i}"].outputs[0].finish_reason == "length"]
    refs = roomy.generate([requests[i][0] for i in kept], [requests[i][1] for i in kept], use_tqdm=False)
    for i, ref in zip(kept, refs):
        assert done[f"r{i}"].outputs[0].token_ids == ref.outputs[0].token_ids, f"seed {seed}: request {i}"
