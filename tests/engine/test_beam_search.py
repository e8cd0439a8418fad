"""Beam search equals transformers' generate(num_beams=k, do_sample=False, length_penalty=...)
on the same model, and its beams share KV blocks (fork + copy-on-write)."""

import pytest
import torch

from pagedllm import LLM
from engine.test_logprobs import hf_logprobs

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "My favourite season is",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=512)


EOS = 2


def hf_beam_hypotheses(hf_model, prompt_ids, width, length_penalty, max_new_tokens, num_return=1):
    """transformers' generate(num_beams=width): the num_return best hypotheses, best first, as
    (token ids, sequences_score). Each is cut after its EOS (transformers pads a hypothesis that
    ended early with the pad id, here EOS). sequences_scores is the hypothesis' sum of token
    logprobs (log_softmax of the raw logits: no processor is configured) divided by its
    generated length (EOS included) ** length_penalty."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=width,
            do_sample=False,
            length_penalty=length_penalty,
            max_new_tokens=max_new_tokens,
            early_stopping=False,
            num_return_sequences=num_return,
            output_scores=True,
            return_dict_in_generate=True,
        )
    hyps = []
    for row, score in zip(out.sequences[:, len(prompt_ids) :].tolist(), out.sequences_scores.tolist()):
        hyps.append((row[: row.index(EOS) + 1] if EOS in row else row, score))
    return hyps


def hf_beam_search(hf_model, prompt_ids, width, length_penalty, max_new_tokens, num_return=1):
    """The token ids of hf_beam_hypotheses."""
    return [t for t, _ in hf_beam_hypotheses(hf_model, prompt_ids, width, length_penalty, max_new_tokens, num_return)]


@pytest.mark.parametrize("width, length_penalty", [(2, 1.5), (4, 0.6)])
def test_beam_search_matches_transformers(llm, hf_model, tokenizer, width, length_penalty):
    """Every hypothesis, best first: its tokens, its score against transformers' sequences_scores,
    its cumulative logprob (the score times len ** length_penalty) and each token's logprob,
    within 1e-4."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = llm.beam_search([{"prompt_token_ids": p} for p in prompts], width, 20, length_penalty)
    for p, out in zip(prompts, ours):
        refs = hf_beam_hypotheses(hf_model, p, width, length_penalty, 20, num_return=width)
        assert len(out.sequences) == width
        for rank, (seq, (ref_tokens, ref_score)) in enumerate(zip(out.sequences, refs)):
            where = (tokenizer.decode(p), rank, seq.tokens, ref_tokens)
            assert seq.tokens == ref_tokens, where
            assert abs(seq.score - ref_score) < 1e-4, (where, seq.score, ref_score)
            assert abs(seq.cum_logprob - ref_score * len(ref_tokens) ** length_penalty) < 1e-4, where
            # Each token's logprob (the server's logprobs): log_softmax of transformers' logits.
            ref = hf_logprobs(hf_model, p, ref_tokens)[range(len(ref_tokens)), ref_tokens]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.tolist())) < 1e-4, where
            assert len(seq.logprobs) == len(ref_tokens) and abs(sum(seq.logprobs) - seq.cum_logprob) < 1e-4
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_beams_share_blocks(llm):
    """Mid-search, the beams of one 200-token prompt hold its blocks once."""
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    seen = []
    step = engine.core.step

    def spy():
        out = step()
        sched = engine.core.scheduler
        if len(sched.running) == 4:
            seen.append(kv.block_pool.num_blocks - 1 - kv.num_free_blocks())
        return out

    engine.core.step = spy
    try:
        llm.beam_search({"prompt_token_ids": [(i * 31) % 3000 + 100 for i in range(200)]}, 4, 12, ignore_eos=True)
    finally:
        engine.core.step = step
    assert seen, "the search never had 4 live beams"
    # 12 full blocks of the prompt once + at most 2 own blocks per beam; private copies would be 4 x 13.
    assert max(seen) <= 200 // 16 + 4 * 2, seen


def test_beam_search_bad_input(llm):
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search("Hi", 0, 5)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search("Hi", 2, 0)
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search("", 2, 5)
