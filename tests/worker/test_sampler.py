"""Sampler unit tests: no model, small vocabularies, fixed seeds (nothing can flake)."""

import math

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p

V = 32
NEG = float("-inf")


def md_for(params, vocab=V, prompts=None, outputs=None, gens=None, stops=None):
    B = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(B)],
        outputs if outputs is not None else [[] for _ in range(B)],
        gens if gens is not None else [None] * B,
        stops if stops is not None else [set() for _ in range(B)],
        vocab,
    )


def rand_logits(B, vocab=V, seed=0):
    return torch.randn(B, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_does_not_touch_logits():
    logits = rand_logits(5)
    before = logits.clone()
    md = md_for([SamplingParams(temperature=0.0)] * 5)
    assert md.all_greedy and md.no_penalties and md.no_logit_bias
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None
    assert torch.equal(logits, before)


def test_greedy_rows_in_mixed_batch_are_exact_argmax():
    logits = rand_logits(6, seed=1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.2, top_k=4),
    ]
    out = Sampler()(logits, md_for(params, outputs=[[1, 2]] * 6, prompts=[[3]] * 6))
    for i in (0, 2, 4):
        assert out.sampled_token_ids[i] == logits[i].argmax()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    torch.manual_seed(0)
    logits = rand_logits(8, seed=2)
    # top_p=1e-9: 1 - p rounds to 1.0 in float32, so only the keep-one rule saves the top token.
    for p in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, top_p=1e-9),
    ):
        md = md_for([p] * 8)
        assert md.all_random
        for _ in range(5):
            assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def _ref_keep(logits_row, k, p):
    """Reference per row: top-k by value, then top-p on the renormalised survivors."""
    order = sorted(range(len(logits_row)), key=lambda i: -logits_row[i])
    if k is not None:
        order = order[:k]
    z = [math.exp(logits_row[i] - logits_row[order[0]]) for i in order]
    s = sum(z)
    keep, cum = set(), 0.0
    for i, zi in zip(order, z):
        if p is not None and cum >= p:
            break
        keep.add(i)
        cum += zi / s
    return keep


def test_top_k_top_p_masks_match_reference():
    # Distinct probabilities with cumulative sums well away from the p values used.
    probs = torch.tensor([0.05, 0.30, 0.02, 0.15, 0.25, 0.08, 0.12, 0.03])
    base = probs.log()
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    rows = torch.stack([base, base[perm], base + 1.0, base[perm] * 0.5])  # [4, 8]
    ks = [1, 3, 5, 8]
    ps = [0.1, 0.5, 0.72, 0.9, 1.0]
    for k in ks:
        for p in ps:
            for use_k, use_p in ((True, False), (False, True), (True, True)):
                kt = torch.full((4,), k) if use_k else None
                pt = torch.full((4,), p) if use_p else None
                out = apply_top_k_top_p(rows.clone(), kt, pt)
                for r in range(4):
                    kept = {i for i in range(8) if out[r, i] != NEG}
                    assert kept == _ref_keep(rows[r].tolist(), k if use_k else None, p if use_p else None), (
                        k,
                        p,
                        use_k,
                        use_p,
                        r,
                    )
                    # Survivors keep their values.
                    assert torch.equal(out[r][out[r] != NEG], rows[r][out[r] != NEG])


def test_top_k_top_p_per_row_values():
    logits = rand_logits(4, seed=3)
    k = torch.tensor([2, V, 5, 1])
    p = torch.tensor([1.0, 0.3, 0.6, 0.9])
    out = apply_top_k_top_p(logits, k, p)
    for r in range(4):
        kept = {i for i in range(V) if out[r, i] != NEG}
        assert kept == _ref_keep(logits[r].tolist(), int(k[r]), float(p[r]))


def _ref_keep_fast(row, k, p):
    """Vectorised form of _ref_keep for wide rows (float64, full sort)."""
    vals, idx = row.double().sort(descending=True)
    if k is not None:
        vals, idx = vals[:k], idx[:k]
    probs = torch.softmax(vals, 0)
    above = probs.cumsum(0) - probs
    n = int((above < p).sum()) if p is not None else len(idx)
    return set(idx[: max(n, 1)].tolist())


def test_top_p_wide_vocab_widens_candidates():
    # Vocab 4096: a peaked row (top-p set inside the first 128 candidates), a flat row (needs
    # >1024 tokens) and a top-k row; each must match a full-sort reference.
    vocab = 4096
    g = torch.Generator().manual_seed(11)
    logits = torch.stack(
        [
            torch.randn(vocab, generator=g) * 4,
            torch.randn(vocab, generator=g) * 0.05,
            torch.randn(vocab, generator=g),
            torch.randn(vocab, generator=g),
        ]
    )
    k = torch.tensor([vocab, vocab, 200, vocab])
    p = torch.tensor([0.9, 0.95, 0.8, 1.0])
    out = apply_top_k_top_p(logits, k, p)
    for r in range(4):
        kept = set((out[r] != NEG).nonzero()[:, 0].tolist())
        ref = _ref_keep_fast(logits[r], None if k[r] >= vocab else int(k[r]), float(p[r]))
        assert kept == ref, r
    assert len(set((out[1] != NEG).nonzero()[:, 0].tolist())) > 1024
    # A row's mask does not depend on its neighbours (which decide the candidate width).
    for r in range(4):
        alone = apply_top_k_top_p(logits[r : r + 1], k[r : r + 1], p[r : r + 1])
        assert torch.equal(alone[0], out[r])
    # Explicit max_k and the k-only path agree with the combined path on rows with p = 1.
    assert torch.equal(apply_top_k_top_p(logits, k, None, max_k=200), apply_top_k_top_p(logits, k, torch.ones(4)))


def test_min_p_filters():
    probs = torch.tensor([[0.5, 0.2, 0.1, 0.09, 0.11], [0.2, 0.2, 0.2, 0.2, 0.2]])
    out = apply_min_p(probs.log(), torch.tensor([0.21, 0.9]))
    # threshold row 0: 0.105 -> keeps 0.5, 0.2, 0.11; row 1: 0.18 -> keeps all
    assert (out[0] != NEG).tolist() == [True, True, False, False, True]
    assert (out[1] != NEG).all()
    # Through the sampler: min_p=1 keeps only the most likely token.
    logits = rand_logits(6, seed=4)
    md = md_for([SamplingParams(temperature=2.0, min_p=1.0)] * 6)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def test_penalties_hand_computed():
    from pagedllm.worker.sampler import apply_logits_processors

    logits = torch.tensor(
        [[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]]
    )
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[3, 3], [2, 2, 2, 5], [2]]
    md = md_for(params, vocab=6, prompts=prompts, outputs=outputs)
    assert not md.no_penalties
    got = apply_logits_processors(logits, md)
    # row 0: seen {0,1,3}: 2/2, -1*2, -3*2 (prompt-only and output-only both count)
    # row 1: output counts {2:3, 5:1}: 0.5 - 0.5 - 0.75 ; 0 - 0.5 - 0.25 (prompt ignored)
    # row 2: no penalties, unchanged bit for bit
    want = torch.tensor(
        [[1.0, -2.0, 0.5, -6.0, 1.0, 0.0], [2.0, -1.0, -0.75, -3.0, 1.0, -0.75], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]]
    )
    assert torch.equal(got, want)
    # Greedy with repetition penalty moves argmax off the repeated token.
    g = md_for([SamplingParams(temperature=0, repetition_penalty=4.0)], vocab=6, prompts=[[0]], outputs=[[]])
    assert Sampler()(logits[:1], g).sampled_token_ids.item() == 4


def test_logit_bias_forces_token():
    logits = rand_logits(4, seed=5)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={9: 100.0, 999: 5.0}),  # 999: out of vocab
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    md = md_for(params)
    assert not md.no_logit_bias
    out = Sampler()(logits, md).sampled_token_ids
    assert out[0] == 7 and out[1] == 9 and out[2] == logits[2].argmax()
    assert out[3] == logits[3].topk(2).indices[1]


def test_min_tokens_masks_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS, most likely
    logits[:, 5] = 9.0  # a stop id
    logits[:, 7] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=3)] * 3
    stops = [{2, 5}] * 3
    outputs = [[1], [1, 1, 1], [1, 1]]  # row 1 has reached min_tokens
    out = Sampler()(logits, md_for(params, outputs=outputs, stops=stops)).sampled_token_ids
    assert out.tolist() == [7, 2, 7]
    # Random rows too: the stop ids get no probability at all.
    torch.manual_seed(0)
    md = md_for([SamplingParams(temperature=5.0, min_tokens=1)] * 200, stops=[{2, 5}] * 200)
    out = Sampler()(torch.zeros(200, V), md).sampled_token_ids
    assert not ({2, 5} & set(out.tolist()))


def _run_steps(params_row, logits_steps, batch_builder):
    """Sample several steps for one seeded request; batch_builder places it in a batch."""
    gen = torch.Generator().manual_seed(params_row.seed)
    toks = []
    for step, logits in enumerate(logits_steps):
        params, gens, rows, row = batch_builder(params_row, gen, logits, step)
        out = Sampler()(rows, md_for(params, gens=gens)).sampled_token_ids
        toks.append(out[row].item())
    return toks


def test_seeded_rows_reproducible_and_independent_of_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    steps = [rand_logits(1, seed=100 + s)[0] * 0.3 for s in range(6)]  # flat: many candidates

    def alone(p, gen, logits, step):
        return [p], [gen], logits[None], 0

    def in_batch(p, gen, logits, step):
        others = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_k=3),
            SamplingParams(temperature=1.0, seed=7),
            SamplingParams(temperature=1.2, min_p=0.1),
            SamplingParams(temperature=1.0, repetition_penalty=1.2),
            SamplingParams(temperature=0.5, top_p=0.3, logprobs=2),
            SamplingParams(temperature=1.0, logit_bias={3: 2.0}),
        ]
        row = (step * 3) % 8  # a different position each step
        params = others[:row] + [p] + others[row:]
        gens = [None] * 8
        gens[row] = gen
        gens[(row + 3) % 8 if (row + 3) % 8 != row else 0] = torch.Generator().manual_seed(step)
        rows = rand_logits(8, seed=200 + step)
        rows[row] = logits
        return params, gens, rows, row

    a = _run_steps(seeded, steps, alone)
    b = _run_steps(seeded, steps, in_batch)
    c = _run_steps(seeded, steps, alone)
    assert a == b == c
    # The generator really advances: the same logits at each step do not repeat one token forever.
    same = _run_steps(seeded, [steps[0]] * 12, alone)
    assert len(set(same)) > 1


def test_generator_untouched_by_greedy_rows():
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    Sampler()(rand_logits(1), md_for([SamplingParams(temperature=0, seed=5)], gens=[gen]))
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.5, -1), (1.0, 4)])
def test_empirical_distribution_matches_softmax(temperature, top_k):
    vocab, n = 8, 40000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    md = md_for([SamplingParams(temperature=temperature, top_k=top_k)] * n, vocab=vocab)
    torch.manual_seed(1234)
    out = Sampler()(logits.expand(n, vocab), md).sampled_token_ids
    counts = torch.bincount(out, minlength=vocab).double()
    z = logits.double() / temperature
    if top_k > 0:
        z[z < z.topk(top_k).values[-1]] = float("-inf")
    expected = torch.softmax(z, -1) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum().item()
    # df <= 7: P(chi2 > 30) < 1e-4 under the null hypothesis; fixed seed anyway.
    assert chi2 < 30, (chi2, counts, expected)


def test_logprobs_shape_values_ranks():
    B = 4
    logits = rand_logits(B, seed=9)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logit_bias={0: 100.0}),  # no logprobs of its own
        SamplingParams(temperature=2.0, top_k=10),
    ]
    out = Sampler()(logits, md_for(params, prompts=[[1, 2, 3]] * B))
    k = 3
    assert out.logprob_token_ids.shape == (B, k + 1) and out.logprobs.shape == (B, k + 1)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits, -1)  # from the raw logits, before bias/penalties/temperature
    s = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], s)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, s[:, None])[:, 0])
    top = raw.topk(k, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()  # sorted descending
    for r in range(B):
        order = raw[r].argsort(descending=True).tolist()
        assert out.sampled_token_ranks[r].item() == order.index(s[r].item()) + 1
    assert out.sampled_token_ranks[0] == 1
    assert s[2] == 0 and out.sampled_token_ranks[2] > 1


def test_logprobs_k0_shape():
    out = Sampler()(rand_logits(2), md_for([SamplingParams(temperature=0, logprobs=0)] * 2))
    assert out.logprob_token_ids.shape == (2, 1) and out.sampled_token_ranks.tolist() == [1, 1]


def test_flags_for_unused_features():
    md = md_for([SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.3), SamplingParams(temperature=1.0)])
    # Sampling knobs on greedy rows do not switch the features on for the batch.
    assert md.no_top_k and md.no_top_p and md.no_min_p and md.no_penalties
    assert md.prompt_token_ids is None and md.max_num_logprobs is None
    assert not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == [0.0, 1.0]
