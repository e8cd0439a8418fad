"""A tiny random-weight Gemma 3 with its vision tower (Gemma3ForConditionalGeneration) built with
transformers' own classes: the SmolLM2 tokenizer with Gemma 3's image tokens added (as its
boi / eoi / image special tokens) and Gemma 3's chat template, transformers' Gemma3Processor over Gemma 3's image processor
at 32 x 32 pixels; 16 tokens an image, a sliding window of 8 (shorter than an image, so the
window cuts into an image's bidirectional block)."""

from __future__ import annotations

from models.vlm_fixture import SMOLLM2

IMAGE = "<start_of_image>"  # what a prompt writes where an image goes
IMAGE_TOKENS = 16
QK_NORM = 2.0
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# Gemma 3's own chat template (google/gemma-3-4b-it's tokenizer_config.json): it iterates over
# content parts, trims their text and writes each image part as <start_of_image>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)


def build_tiny_gemma3v(path: str) -> str:
    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(SMOLLM2, extra_special_tokens=SPECIAL)
    tok.chat_template = GEMMA3_TEMPLATE
    proc = Gemma3Processor(
        Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tok, image_seq_length=IMAGE_TOKENS
    )
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    # 8 x 8 patches of 4 pixels, average-pooled by 2 into 4 x 4 = 16 tokens.
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=4,
        vision_use_head=False,
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_id=tok.image_token_id,
        boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.eoi_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the projection starts at zero: random and wide, so that images change the tokens
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(torch.randn_like(proj))
        for layer in model.model.language_model.layers:  # sharp attention, so that the image mask shows
            layer.self_attn.q_norm.weight.fill_(QK_NORM)
            layer.self_attn.k_norm.weight.fill_(QK_NORM)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


def hf_greedy(path: str, prompt: str, images: list, max_tokens: int, bidirectional: bool = True) -> list[int]:
    """transformers' own Gemma3ForConditionalGeneration, greedy, on the same checkpoint;
    bidirectional False: without token_type_ids (every token causal), to show the mask matters."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    proc = AutoProcessor.from_pretrained(path)
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(images=[images]) if images else {}
    inputs = proc(text=[prompt], return_tensors="pt", **kw)
    if not bidirectional:
        inputs.pop("token_type_ids")
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
