"""A tiny random-weight Llama with a small byte-level BPE tokenizer and a ChatML template, made
on this machine in a second. A random model samples almost uniformly, so a grammar alone must
make its output valid (JSON, regex, choice, tool calls). The tokenizer has fewer ids (~400) than
the model's logits (512): the grammar's bitmask must cover the padding ids too."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
TOKENIZER_VOCAB = 400
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (EOS: <|im_end|>)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_CORPUS = [
    '{"name": "Paris", "age": 42, "city": "Rome", "items": [1, 2, 3], "ok": true, "note": null}',
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
    "<think>the user wants an answer</think> The answer is 12 + 30 = 42.",
    "You are a helpful assistant. Answer in JSON. The weather in Paris is sunny.",
]


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No control characters but "\n": xgrammar's JSON strings admit raw U+0000-U+001F (but \r, \n),
    # which JSON forbids (README: limits), so a model that can write them could break the JSON.
    # GPT-2's byte-level alphabet writes byte b < 0x21 as chr(256 + b).
    controls = {chr(256 + b) for b in range(0x20) if b != 0x0A}
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in controls]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL[1],
                "eos_token": SPECIAL[2],
                "pad_token": SPECIAL[0],
                "model_max_length": 1 << 30,
                "chat_template": CHATML,
            }
        )
    )


def make_tiny_chat_model(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.random_model import SHAPES

    if (out / "config.json").is_file():
        return out
    spec = dict(SHAPES["tiny"])
    spec.pop("torch_dtype")
    spec.update(vocab_size=VOCAB_SIZE, max_position_embeddings=2048)
    cfg = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype=torch.float32)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out
