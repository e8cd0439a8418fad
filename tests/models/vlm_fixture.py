"""A tiny random-weight Idefics3 (SmolVLM) checkpoint built with transformers' own classes, its
processor from the SmolLM2 tokenizer and an image processor config (no hub), and test images."""

from __future__ import annotations

import os

import numpy as np

SMOLLM2 = os.path.expanduser("~/.cache/pagedllm/models/SmolLM2-135M-Instruct")
IMAGE_TOKENS = 16  # (64 / 8)^2 patches, pixel-shuffled by 2

# SmolVLM's own chat template (its processor's): it iterates over the content parts and puts
# <image> where a {"type": "image"} part stands.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build_tiny_idefics3(path: str, do_image_splitting: bool = False) -> str:
    """do_image_splitting: SmolVLM's default, here an image's longest edge is resized to 128 and
    it is cut into 64 x 64 tiles (up to 2 x 2) plus the whole image at 64."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    ip = Idefics3ImageProcessorPil(
        do_image_splitting=do_image_splitting,
        size={"longest_edge": 128 if do_image_splitting else 64},
        max_image_size={"longest_edge": 64},
    )
    proc = Idefics3Processor(ip, tok, image_seq_len=IMAGE_TOKENS)
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=8
    )
    cfg = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=proc.image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random init is small: widen it so that the images change the tokens
        for p in model.model.connector.parameters():
            p.mul_(20)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


def image(seed: int, size=(48, 80)):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))


def hf_greedy(path: str, prompt: str, images: list, max_tokens: int) -> list[int]:
    """transformers' own Idefics3ForConditionalGeneration, greedy, on the same checkpoint."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(images=[images]) if images else {}
    inputs = proc(text=[prompt], return_tensors="pt", **kw)
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def mm_prompt(text: str, images: list):
    """LLM.generate's prompt: with multi_modal_data when there are images, else the text."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def greedy(max_tokens: int):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def generate_checked(llm, cases: list, refs: list, max_tokens: int) -> None:
    """cases: (prompt, images) in one batch; greedy tokens equal refs, each image encoded once,
    and nothing left in the encoder cache."""
    outs = llm.generate([mm_prompt(t, imgs) for t, imgs in cases], greedy(max_tokens), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    cache = llm.llm_engine.core.model_executor.driver_worker.model_runner.encoder_cache
    assert cache.images_encoded == sum(len(imgs) for _, imgs in cases)
    assert cache.features == {} and cache.users == {}  # freed once prefilled
