"""Logprob values against transformers: the engine reports log_softmax of the *raw* logits (before
logit_bias, penalties, temperature; vLLM's default `raw_logprobs`), so every reported value must
equal torch.log_softmax of transformers' logits on the same weights at the same position, within
1e-4, whatever the request's temperature and penalties: the sampled token's logprob and rank, and
each top-k entry's id, value and rank. The checks here are shared with test_server_logprobs.py.

Ties: where the reference's values at two ranks are within TOL, either id may take the rank (the
value at each rank is still checked), as in the greedy-equality rule of docs/design.md.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from server_utils import TINY

TOL = 1e-4


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V]: log_softmax of transformers' logits for each output token's position
    (one forward over prompt + output; the logits at position i predict token i + 1)."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 : ids.shape[1] - 1]
    return torch.log_softmax(logits.double(), dim=-1)


def check_position(
    ref: torch.Tensor,
    sampled: int,
    sampled_lp: float,
    top: list[tuple[int, float]],
    k: int,
    sampled_rank: int | None = None,
    where: str = "",
) -> None:
    """One position against its reference row `ref` [V]. `top`: the reported top-k as (id, value),
    most likely first (rank j + 1 at index j)."""
    assert abs(sampled_lp - float(ref[sampled])) < TOL, (where, sampled, sampled_lp, float(ref[sampled]))
    if sampled_rank is not None:  # 1 + the number of tokens more likely, ties within TOL either way
        lo = int((ref > ref[sampled] + TOL).sum()) + 1
        hi = int((ref > ref[sampled] - TOL).sum())  # counts the sampled token itself
        assert lo <= sampled_rank <= hi, (where, sampled, sampled_rank, lo, hi)
    ref_top = ref.topk(k).values.tolist()
    assert len(top) == k and len({t for t, _ in top}) == k, (where, top)
    for j, (tid, lp) in enumerate(top):
        assert abs(lp - float(ref[tid])) < TOL, (where, j, tid, lp, float(ref[tid]))
        assert abs(lp - ref_top[j]) < TOL, (where, "rank", j + 1, tid, lp, ref_top[j])


def check_logprob_dicts(ref: torch.Tensor, token_ids: list[int], dicts, k: int, where: str = "") -> None:
    """{id: Logprob} per position (the chosen / prompt token first, then the top k ranked 1..k)
    against the reference rows `ref` [len(token_ids), V]."""
    for i, (tid, pos) in enumerate(zip(token_ids, dicts)):
        first, first_lp = next(iter(pos.items()))
        assert first == tid, (where, i, "the sampled token comes first")
        top = sorted(
            ((t, lp) for t, lp in pos.items() if lp.rank <= k and (t != tid or len(pos) == k)), key=lambda e: e[1].rank
        )
        assert len(pos) == k + (tid not in dict(top)), (where, i, pos)
        check_position(
            ref[i], tid, first_lp.logprob, [(t, lp.logprob) for t, lp in top], k, first_lp.rank, f"{where} token {i}"
        )
        assert [lp.rank for _, lp in top] == list(range(1, k + 1)), (where, i, pos)
        assert all(isinstance(lp.decoded_token, str) for lp in pos.values()), (where, i, pos)


def check_completion(hf_model, prompt_ids, c, k: int, where: str = "") -> int:
    """An offline CompletionOutput (logprobs=k) against transformers; -> positions checked."""
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids), where
    ref = hf_logprobs(hf_model, prompt_ids, c.token_ids)
    check_logprob_dicts(ref, c.token_ids, c.logprobs, k, where)
    # The cumulative logprob is the sum of the sampled tokens' logprobs.
    want = float(ref[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)].sum())
    assert abs(c.cumulative_logprob - want) < TOL * max(1, len(c.token_ids)), (where, c.cumulative_logprob, want)
    return len(c.token_ids)


# ------------------------------------------------------------------ tiny random model
@pytest.fixture(scope="module")
def tiny_dir():
    from pagedllm.models.random_model import random_model_dir

    return str(random_model_dir(TINY))


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llm():
    # A small token budget: the long prompts are prefilled in chunks, batched with decodes.
    return LLM(TINY, max_model_len=256, max_num_batched_tokens=48, max_num_seqs=16)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


# Each changes the processed logits or how a token is drawn, never the reported values.
CASES = {
    "greedy": SamplingParams(temperature=0, logprobs=5),
    "k0": SamplingParams(temperature=0, logprobs=0),
    "temperature": SamplingParams(temperature=0.7, seed=1, logprobs=3),
    "hot": SamplingParams(temperature=1.8, seed=2, logprobs=20),
    "penalties": SamplingParams(
        temperature=0.9, seed=3, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.5, logprobs=4
    ),
    "greedy+penalty+bias": SamplingParams(
        temperature=0, repetition_penalty=1.3, logit_bias={7: 5.0, 9: -3.0}, logprobs=2
    ),
    "top_k/top_p/min_p": SamplingParams(temperature=1.0, seed=4, top_k=20, top_p=0.9, min_p=0.05, logprobs=6),
    "n=2": SamplingParams(n=2, temperature=1.0, seed=5, logprobs=1),
}


@pytest.mark.timeout(120)
def test_logprobs_equal_transformers_tiny(tiny_llm, tiny_hf):
    """All cases in one batch (rows with and without logprobs, greedy and random, chunked
    prefill next to decodes), plus a plain greedy row that asks for none."""
    names = list(CASES)
    prompts = [_prompt(i, 5 + 23 * i) for i in range(len(names))]
    params = [_with(CASES[n], max_tokens=12, ignore_eos=True) for n in names]
    outs = tiny_llm.generate(
        [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": _prompt(99, 30)}],
        params + [SamplingParams(temperature=0, max_tokens=12)],
        use_tqdm=False,
    )
    checked = 0
    for name, p, sp, out in zip(names, prompts, params, outs):
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            checked += check_completion(tiny_hf, p, c, sp.logprobs, f"{name}[{c.index}]")
    assert checked == 12 * (len(names) + 1)
    assert outs[-1].outputs[0].logprobs is None and outs[-1].outputs[0].cumulative_logprob is None


def _with(sp: SamplingParams, **kw) -> SamplingParams:
    c = sp.clone()
    for k, v in kw.items():
        setattr(c, k, v)
    return c


# ------------------------------------------------------------------ the real default model
@pytest.mark.model
@pytest.mark.timeout(300)
def test_logprobs_equal_transformers_default_model(model_dir, hf_model, tokenizer):
    """One sampled request with a penalty (values of the raw logits, not of the processed ones)
    and one greedy request with the widest top-k, side by side in one batch."""
    llm = LLM(model_dir, max_model_len=256)
    prompts = [tokenizer(p)["input_ids"] for p in ("The capital of France is", "def fibonacci(n):")]
    params = [
        SamplingParams(temperature=0.8, seed=0, repetition_penalty=1.3, logprobs=5, max_tokens=8),
        SamplingParams(temperature=0, logprobs=20, max_tokens=8),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs):
        check_completion(hf_model, p, out.outputs[0], sp.logprobs, tokenizer.decode(p))
