"""A tiny random-weight Qwen2-VL (or Qwen2.5-VL) checkpoint built with transformers' own classes, the SmolLM2
tokenizer with Qwen2-VL's vision tokens added and Qwen2-VL's image processor, whose
min/max_pixels keep the images at a few patches. (transformers' Qwen2VLProcessor needs
torchvision for its video half; the engine and the reference expand the image tokens
themselves.)"""

from __future__ import annotations

from models.vlm_fixture import SMOLLM2

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
# Qwen2-VL-Instruct's own chat template (its tokenizer_config.json): it iterates over content parts
# and writes each image part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2.5-VL's vision tower: windows of 56 pixels (2 x 2 merged groups, so a 3 x 3 grid has
# windows of 4, 2, 2 and 1 groups), whole-image attention in blocks 1 and 3 of 4.
QWEN2_5_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1, 3],
)


def build_tiny_qwen2vl(path: str, qwen2_5: bool = False) -> str:
    """Qwen2-VL, or with qwen2_5 Qwen2.5-VL (the same text model and processor)."""
    import torch
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = QWEN2_VL_TEMPLATE
    side = PATCH * MERGE  # 28: one merged token
    ip = Qwen2VLImageProcessorPil(min_pixels=4 * side * side, max_pixels=12 * side * side)
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = (
        QWEN2_5_VISION
        if qwen2_5
        else dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
        )
    )
    name = "Qwen2_5_VL" if qwen2_5 else "Qwen2VL"
    cfg = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[2],
        video_token_id=ids[3],
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():  # random init is small: widen the merger so that images change the tokens
        for p in model.model.visual.merger.parameters():
            p.mul_(20)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    return path


def hf_model(path: str):
    """transformers' own class of the checkpoint's architecture, float32."""
    import json

    import torch
    import transformers

    with open(f"{path}/config.json") as f:
        arch = json.load(f)["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, as Qwen2-VL's chat template writes it


def hf_inputs(path: str, prompt: str, images: list) -> dict:
    """transformers' model inputs: the image processor's patches and grids, each image token
    repeated t*h*w/merge^2 times (what Qwen2VLProcessor does), mm_token_type_ids 1 on them."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, kw = tok(prompt)["input_ids"], {}
    if images:
        out = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // MERGE**2).tolist())
        ids = [j for i in ids for j in ([i] * next(counts) if i == image_id else [i])]
        kw = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, mm_token_type_ids=(input_ids == image_id).int(), **kw)


def hf_greedy(path: str, prompt: str, images: list, max_tokens: int) -> list[int]:
    """transformers' own Qwen2VLForConditionalGeneration (or Qwen2.5-VL's), greedy, on the same checkpoint."""
    model = hf_model(path)
    inputs = hf_inputs(path, prompt, images)
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
