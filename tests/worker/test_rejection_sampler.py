"""RejectionSampler keeps the target distribution: on a random-weight model with a small vocabulary
(random:tiny, 512 ids), the first token emitted after verifying drafts is distributed as the
target's own (processed) probabilities, by a chi-square test at a fixed seed; a deliberately
wrong rule (resampling from p instead of norm(max(0, p - q)) after a rejection) fails the same
test. Greedy is argmax matching; seeded requests do not depend on their batch."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from pagedllm import SamplingParams
from pagedllm.models.random_model import random_model_dir
from pagedllm.worker.rejection_sampler import RejectionSampler
from pagedllm.worker.sampler import SamplingMetadata, random_probs

N = 12000  # trials, one batch row each
PROMPT = [5, 9, 33, 7, 101, 12]


@pytest.fixture(scope="module")
def logits():
    """The tiny model's logits at the last prompt token and after 2 drafts: [3, 512]."""
    model = AutoModelForCausalLM.from_pretrained(random_model_dir("random:tiny"))
    with torch.inference_mode():
        drafts = []
        for _ in range(2):  # the target's likeliest continuation: drafts often accepted, not always
            drafts.append(int(model(torch.tensor([PROMPT + drafts])).logits[0, -1].argmax()))
        out = model(torch.tensor([PROMPT + drafts])).logits[0, -3:]
    return out.float() * 4, drafts  # sharper than the random model's near-uniform logits


def metadata(params: SamplingParams, rows: int, output_ids=()) -> SamplingMetadata:
    return SamplingMetadata.build(
        [params] * rows, [PROMPT] * rows, [list(output_ids)] * rows, [None] * rows, [set()] * rows, 512
    )


def target_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return random_probs(row_logits[None], metadata(params, 1))[0].double()


def assert_distributed_as(samples: list[int], p: torch.Tensor) -> None:
    counts = np.bincount(samples, minlength=p.shape[0]).astype(float)
    expected = p.numpy() * len(samples)
    big = expected >= 5  # the rare tokens pooled into one bin
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    keep = f_exp > 0
    assert np.all(counts[p.numpy() == 0] == 0), "a token the target excludes was emitted"
    assert chisquare(f_obs[keep], f_exp[keep] * f_obs.sum() / f_exp[keep].sum()).pvalue > 1e-3


def run(sampler, logits, drafts, params, draft_probs=None, seed=0):
    torch.manual_seed(seed)
    batch_logits = logits.repeat(N, 1)  # [N * 3, V]
    draft_rows = drafts if isinstance(drafts[0], list) else [drafts] * N
    md = SamplingMetadata.build(
        [params] * (3 * N),
        [PROMPT] * (3 * N),
        [[], draft_rows[0][:1], draft_rows[0][:2]] * N,
        [None] * (3 * N),
        [set()] * (3 * N),
        512,
    )
    return sampler(batch_logits, draft_rows, md, [None] * N, draft_probs)


PARAMS = SamplingParams(temperature=0.8, top_k=40)


class ResampleFromTarget(RejectionSampler):
    """The wrong rule: after a rejection draw from p, not from norm(max(0, p - q))."""

    @staticmethod
    def residual(p_last, n_acc, drafts, ks, draft_probs):
        return p_last.clone()


def test_ngram_one_hot_keeps_the_target_distribution(logits):
    row_logits, drafts = logits
    p0 = target_probs(row_logits[0], PARAMS)
    out = run(RejectionSampler(), row_logits, drafts, PARAMS)
    assert_distributed_as([o[0] for o in out], p0)
    # Every emitted sequence is accepted drafts followed by one sampled token.
    assert all(o[: len(o) - 1] == drafts[: len(o) - 1] for o in out)
    assert any(len(o) == 3 for o in out) and any(len(o) == 1 for o in out)  # bonus and rejections seen
    # Given draft 0 accepted, the second token follows p1 (the target after it).
    second = [o[1] for o in out if len(o) >= 2]
    assert_distributed_as(second, target_probs(row_logits[1], PARAMS))


def test_a_wrong_acceptance_rule_fails_the_same_test(logits):
    row_logits, drafts = logits
    out = run(ResampleFromTarget(), row_logits, drafts, PARAMS)
    with pytest.raises(AssertionError):
        assert_distributed_as([o[0] for o in out], target_probs(row_logits[0], PARAMS))


def test_draft_distribution_q_keeps_the_target_distribution(logits):
    """A draft model's q (here the target at a higher temperature): drafts drawn from q per row."""
    row_logits, _ = logits
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(row_logits[:2] / 2.0, dim=-1)  # [2, V]
    d0 = torch.multinomial(q[0], N, replacement=True, generator=g)
    d1 = torch.multinomial(q[1], N, replacement=True, generator=g)
    drafts = torch.stack([d0, d1], dim=1).tolist()
    draft_probs = q[None].expand(N, 2, -1)
    torch.manual_seed(0)
    md = SamplingMetadata.build(
        [PARAMS] * (3 * N), [PROMPT] * (3 * N), [[]] * (3 * N), [None] * (3 * N), [set()] * (3 * N), 512
    )
    out = RejectionSampler()(row_logits.repeat(N, 1), drafts, md, [None] * N, draft_probs)
    assert_distributed_as([o[0] for o in out], target_probs(row_logits[0], PARAMS))


def test_greedy_accepts_the_argmax_prefix(logits):
    row_logits, drafts = logits
    argmax = row_logits.argmax(dim=-1).tolist()
    wrong = (argmax[1] + 1) % 512
    out = RejectionSampler()(row_logits.repeat(2, 1), [[argmax[0], argmax[1]], [argmax[0], wrong]], None, [None, None])
    assert out == [argmax[:3], argmax[:2]]


def test_seeded_request_does_not_depend_on_its_batch(logits):
    row_logits, drafts = logits
    params = SamplingParams(temperature=1.0, seed=3)

    def alone_then_batched():
        outs = []
        for batch in (1, 4):
            gens = [torch.Generator().manual_seed(3)] + [None] * (batch - 1)
            md = SamplingMetadata.build(
                [params] * (3 * batch),
                [PROMPT] * (3 * batch),
                [[], drafts[:1], drafts] * batch,
                [None] * (3 * batch),
                [set()] * (3 * batch),
                512,
            )
            outs.append(RejectionSampler()(row_logits.repeat(batch, 1), [drafts] * batch, md, gens)[0])
        return outs

    a, b = alone_then_batched()
    assert a == b
