"""Qwen 3 (q/k norm per head, head_dim from the config) and Qwen2 with q/k/v bias: greedy output
equal to transformers' generate on the same random weights, token for token, under chunked
prefill with small blocks (ties allowed as DESIGN.md defines them).

The helpers here (a random-weight directory made with transformers' own class, its greedy
reference, the engine run) are shared by test_moe_models.py; the comparison is
test_greedy_equality.py's. Biases and norm weights are drawn at random too (transformers
initialises them to 0 and 1, which would hide a bias or norm that is not loaded)."""

import torch

from engine.test_greedy_equality import assert_greedy_equal  # ties as DESIGN.md allows them
from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 6, 19, 41, 70]
VOCAB = 256
# A small cache of tiny blocks and a token budget that chunks every prompt longer than 16.
CHUNKED = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)


def make_hf_model(path, config_cls, model_cls, **overrides):
    """A random-weight model of transformers' class saved to `path` with a word-level tokenizer;
    returns (path as str, the transformers model in float32)."""
    from pagedllm.models.random_model import _write_tokenizer

    cfg = config_cls(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = model_cls(cfg).float().eval()
    if hasattr(model, "set_experts_implementation"):  # MoE: the plain per-expert loop, not grouped_mm
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    _write_tokenizer(path, cfg.vocab_size)
    return str(path), model


def prompts(n=len(PROMPT_LENGTHS)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in PROMPT_LENGTHS[:n]]


def hf_reference(model, prompt_ids):
    """transformers greedy: (tokens, top-2 logit gap at each step) per prompt."""
    refs = []
    with torch.inference_mode():
        for p in prompt_ids:
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
            gaps = [float(t.topk(2).values[0] - t.topk(2).values[1]) for t in (s[0].float() for s in out.logits)]
            refs.append((out.sequences[0, len(p) :].tolist(), gaps))
    return refs


def run_engine(model_dir, prompt_ids, **settings):
    llm = LLM(model_dir, **settings)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def check_against_transformers(tmp_path, config_cls, model_cls, label, **overrides):
    model_dir, model = make_hf_model(tmp_path, config_cls, model_cls, **overrides)
    ids = prompts()
    assert_greedy_equal(run_engine(model_dir, ids, **CHUNKED), hf_reference(model, ids), label)
    return model_dir, model


def test_qwen3_equals_transformers(tmp_path):
    """q/k RMSNorm per head, and a head_dim (24) that is not hidden / heads (16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from pagedllm.models.qwen3 import Qwen3ForCausalLM as Ours
    from pagedllm.models.registry import get_model_class

    assert get_model_class({"architectures": ["Qwen3ForCausalLM"]}) is Ours
    check_against_transformers(tmp_path, Qwen3Config, Qwen3ForCausalLM, "Qwen3", head_dim=24)


def test_qwen2_with_qkv_bias_equals_transformers(tmp_path):
    """Qwen2's q/k/v projections carry a bias (o_proj none): loaded and added."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, model = check_against_transformers(tmp_path, Qwen2Config, Qwen2ForCausalLM, "Qwen2 bias")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert attn.k_proj.bias.abs().sum() > 0  # the check above would miss a bias left at zero
