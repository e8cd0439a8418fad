"""Qwen2-VL and Qwen2.5-VL against transformers' own Qwen2VLForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration on tiny random-weight checkpoints: the vision towers' image
features (Qwen2.5-VL's windowed attention with uneven windows), greedy tokens with one and two images (of different grids) among text, with a
text-only prompt in the same batch, with images split across chunked-prefill steps, and with
preemption by recompute; the M-RoPE positions against transformers' get_rope_index."""

import numpy as np
import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.models.qwen2_vl import mrope_positions
from pagedllm.sampling_params import SamplingParams
from models.qwen2vl_fixture import IMAGE, MERGE, build_tiny_qwen2vl, hf_greedy, hf_inputs, hf_model
from models.vlm_fixture import generate_checked, image

ONE = f"Look at {IMAGE} and say what you see"
TWO = f"Compare {IMAGE} with {IMAGE} now, please"
TEXT = "The capital of France is"
N = 6


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(tmp_path_factory, request):
    return build_tiny_qwen2vl(str(tmp_path_factory.mktemp(request.param)), qwen2_5=request.param == "qwen2_5_vl")


def _greedy(n=N):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _cases():
    # (height, width) (90, 60) and (48, 80): grids of 6 x 4 and 4 x 6 patches (6 tokens each,
    # one taller than wide, one wider than tall); (120, 100): 6 x 6 patches (max_pixels), 9 tokens.
    return [(ONE, [image(1, (120, 100))]), (TWO, [image(2, (90, 60)), image(3)]), (TEXT, [])]


def _prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def test_image_features_match_transformers(vlm_dir):
    """Two images of different grids in one encoder call: transformers' vision tower's merged
    features (its pooler_output), image by image."""
    _features_match_transformers(vlm_dir)


def test_released_config_field_names(vlm_dir, tmp_path):
    """The checkpoint's vision_config as Qwen's released config.json files write it: `in_chans`
    (and Qwen2.5-VL's `spatial_patch_size`) instead of transformers' `in_channels`. transformers
    reads in_channels (its default, 3) and keeps in_chans unread; the engine builds the same tower,
    whose features are transformers'."""
    import json
    import shutil

    from transformers import AutoConfig

    path = shutil.copytree(vlm_dir, tmp_path / "released")
    cfg = json.loads((path / "config.json").read_text())
    vision = cfg["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    if "fullatt_block_indexes" in vision:
        vision["spatial_patch_size"] = vision["patch_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(path).vision_config
    assert (hf.in_channels, hf.in_chans) == (3, 3)
    _features_match_transformers(str(path))


@pytest.mark.parametrize("field", ["in_channels", "in_chans"])
def test_vision_input_channels_other_than_rgb(vlm_dir, field):
    import json

    from pagedllm.models.qwen2_5_vl import Qwen2_5_VLVisionTransformer
    from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTransformer

    vision = json.load(open(f"{vlm_dir}/config.json"))["vision_config"]
    cls = Qwen2_5_VLVisionTransformer if "fullatt_block_indexes" in vision else Qwen2VLVisionTransformer
    cls({**vision, field: 3})  # RGB: accepted under either name
    with pytest.raises(ValueError, match=f"vision_config.{field} 1 is not supported"):
        cls({**vision, field: 1})


def _features_match_transformers(vlm_dir):
    import torch

    from pagedllm.multimodal.processing import load_mm_processor

    images = [image(1, (120, 100)), image(2, (90, 60)), image(3)]
    model, inputs = hf_model(vlm_dir), hf_inputs(vlm_dir, IMAGE * 3, images)
    with torch.no_grad():
        ref = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    ref = ref.split([9, 6, 6])
    llm = LLM(vlm_dir, dtype="float32")
    _, inputs = load_mm_processor(vlm_dir, model.config.architectures[0]).process(IMAGE * 3, images)
    ours = llm.llm_engine.core.model_executor.driver_worker.model_runner.model.encode_image_list(
        [im.pixel_values for im in inputs]
    )
    for a, b in zip(ours, ref):
        torch.testing.assert_close(
            a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item()
        )  # magnitudes ~ 10 (the widened merger)


def test_mrope_positions_match_transformers(vlm_dir):
    model = hf_model(vlm_dir)
    for text, images in _cases()[:2]:
        inputs = hf_inputs(vlm_dir, text, images)
        ref, ref_delta = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        ids = inputs["input_ids"][0].numpy()
        starts = np.flatnonzero(np.diff(np.r_[0, inputs["mm_token_type_ids"][0].numpy()]) == 1)
        pos, delta = mrope_positions(len(ids), list(zip(starts, inputs["image_grid_thw"].tolist())), MERGE)
        assert np.array_equal(pos, ref[:, 0].numpy()) and delta == int(ref_delta)
        assert delta < 0  # the image's tokens span fewer positions than tokens


@pytest.mark.parametrize("budget", [2048, 4])
def test_greedy_matches_transformers(vlm_dir, budget):
    """One image, two images and a text-only prompt in one batch; a budget of 4 tokens splits
    every image across prefill steps (the encoder cache holds it between them)."""
    refs = [hf_greedy(vlm_dir, t, imgs, N) for t, imgs in _cases()]
    assert refs[0] != hf_greedy(vlm_dir, ONE, [image(4, (120, 100))], N)  # the image decides the tokens
    llm = LLM(vlm_dir, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    generate_checked(llm, _cases(), refs, N)


def test_preemption_keeps_positions(vlm_dir):
    """A KV cache too small for the three image prompts at once: preempted requests resume
    (prompt and generated tokens recomputed, their M-RoPE positions kept) with transformers' tokens."""
    prompts = [(ONE, [image(s, (120, 100))]) for s in (1, 4, 6)]
    refs = [hf_greedy(vlm_dir, t, imgs, 40) for t, imgs in prompts]
    llm = LLM(vlm_dir, dtype="float32", num_gpu_blocks=6, enable_prefix_caching=False)
    outs = llm.generate([_prompt(t, imgs) for t, imgs in prompts], _greedy(40), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert llm.llm_engine.num_preemptions > 0


def test_prefix_cache_reuses_the_image(vlm_dir):
    """The same image and text again: its blocks are reused, the encoder does not run and the
    tokens (positions from the table kept per request) stay transformers'."""
    text, images = _cases()[0]
    llm = LLM(vlm_dir, dtype="float32", enable_prefix_caching=True, block_size=4)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    cache = llm.llm_engine.core.model_executor.driver_worker.model_runner.encoder_cache
    first = llm.generate(_prompt(text, images), _greedy(), use_tqdm=False)
    hits = kv.stats.hits
    again = llm.generate(_prompt(text, images), _greedy(), use_tqdm=False)
    assert kv.stats.hits - hits >= 12 and cache.images_encoded == 1
    assert (
        list(again[0].outputs[0].token_ids)
        == list(first[0].outputs[0].token_ids)
        == hf_greedy(vlm_dir, text, images, N)
    )


def test_qwen_checkpoint_layout(vlm_dir):
    """Qwen's own config.json: the text fields at the top level and rope_scaling of type "mrope"
    give the same text config and rotary tables as transformers' nested layout."""
    import json

    import torch

    from pagedllm.models.hf_config import flatten_multimodal_config
    from pagedllm.models.qwen2_vl import MRotaryEmbedding

    nested = json.load(open(f"{vlm_dir}/config.json"))
    text = nested["text_config"]
    rope = {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]}
    top = {
        **{k: v for k, v in nested.items() if k != "text_config"},
        **{k: v for k, v in text.items() if k != "rope_parameters"},
        "rope_theta": text["rope_parameters"]["rope_theta"],
        "rope_scaling": rope,
    }
    a, b = flatten_multimodal_config(nested), flatten_multimodal_config(top)
    assert a["hidden_size"] == b["hidden_size"] and b["multimodal_config"] is top
    ra, rb = MRotaryEmbedding(a, 16, 64), MRotaryEmbedding(b, 16, 64)
    assert torch.equal(ra.cos, rb.cos) and torch.equal(ra.axis, rb.axis)


def test_window_order_by_hand():
    """Two images: a 3 x 3 merged grid in windows of 2 x 2 groups (4, 2, 2 and 1 groups), then a
    2 x 3 grid (4 and 2), its indices after the first image's 9."""
    from pagedllm.models.qwen2_5_vl import window_order

    order, lengths = window_order([(1, 6, 6), (1, 4, 6)], merge=2, window=2)
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8, 9, 10, 12, 13, 11, 14]
    assert lengths == [16, 8, 8, 4, 16, 8]  # patches: groups x merge^2


@pytest.mark.parametrize(
    "field, value, words", [("hidden_act", "gelu", "hidden_act 'gelu'"), ("window_size", 14, "window_size 14")]
)
def test_bad_qwen2_5_vision_config(field, value, words):
    from models.qwen2vl_fixture import QWEN2_5_VISION
    from pagedllm.models.qwen2_5_vl import Qwen2_5_VLVisionTransformer

    with pytest.raises(ValueError, match=words):
        Qwen2_5_VLVisionTransformer({**QWEN2_5_VISION, field: value})
