"""The greedy argmax kernel (csrc/argmax.cpp) against torch.argmax, every ISA build: random
rows, ties, infinities, NaNs, signed zeros, and the sampler's greedy paths through it."""

import pytest
import torch
from kernel_utils import require_built

from pagedllm.csrc.build import cpu_extension
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata

INF, NAN = float("inf"), float("nan")


def ext():
    return require_built(cpu_extension())


def special_rows(V=70):
    """Rows whose answers torch.argmax fixes by its rules: the first of equal maxima, a NaN as the
    largest value (the first NaN), -0 equal to +0, infinities; maxima at the first and last
    index, and in the scalar tail past the vector chunks."""
    rows = []
    for at in ((0, 5), (3, 69), (68, 69), (40, 41, 66)):  # ties: the first wins
        r = torch.full((V,), -1.0)
        r[list(at)] = 2.5
        rows.append(r)
    r = torch.full((V,), 1.0)
    r[[7, 50]] = NAN
    r[60] = INF
    rows.append(r)  # a NaN beats +inf: the first NaN
    r = torch.full((V,), -INF)
    rows.append(r)  # all -inf: index 0
    r = torch.full((V,), -3.0)
    r[9], r[12] = -0.0, 0.0
    rows.append(r)  # -0 == +0: the first
    r = torch.full((V,), -3.0)
    r[11], r[4] = 0.0, -0.0
    rows.append(r)
    r = torch.full((V,), -5.0)
    r[66] = -1e-30
    rows.append(r)  # tiny negative above larger negatives
    r = torch.full((V,), -INF)
    r[-1] = -1e38
    rows.append(r)
    return torch.stack(rows)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_rows_match_torch_argmax(dtype):
    x = special_rows().to(dtype)
    assert torch.equal(ext().argmax_rows(x), x.argmax(dim=-1))
    assert ext().argmax_rows(x).tolist()[:8] == [0, 3, 68, 40, 7, 0, 9, 4]  # by hand


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,V", [(1, 1), (3, 63), (5, 64), (17, 1000), (16, 49152), (2, 128256)])
def test_random_rows_match_torch_argmax(dtype, B, V):
    g = torch.Generator().manual_seed(B * V)
    x = (torch.randn(B, V, generator=g) * 4).to(dtype)  # bfloat16 rounding makes many ties
    assert torch.equal(ext().argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(B, V + 9, generator=g).to(dtype)[:, 3 : 3 + V]  # a row stride beyond V
    assert torch.equal(ext().argmax_rows(wide), wide.argmax(dim=-1))


@pytest.mark.usefixtures("cpu_isa")
def test_bad_logits_are_refused():
    with pytest.raises(RuntimeError, match="unit stride"):
        ext().argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(RuntimeError, match="V >= 1"):
        ext().argmax_rows(torch.zeros(4, 0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext().argmax_rows(torch.zeros(2, 5, dtype=torch.float16))


def test_sampler_greedy_paths_take_the_kernel_and_agree_with_torch():
    """Plain greedy (no metadata), all-greedy metadata and a mixed batch's greedy rows: the
    kernel-backed sampler and the torch one pick the same tokens; the random row keeps its
    seeded draw."""
    ops = ext()
    logits = (torch.randn(4, 500, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16).float()
    plain = Sampler(ops)(logits, None).sampled_token_ids
    assert torch.equal(plain, Sampler()(logits, None).sampled_token_ids)
    assert torch.equal(plain, logits.argmax(dim=-1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 2

    def md():
        gens = [torch.Generator().manual_seed(3) if p.temperature else None for p in params]
        return SamplingMetadata.build(params, [[]] * 4, [[]] * 4, gens, [set()] * 4, 500)

    mixed = Sampler(ops)(logits, md()).sampled_token_ids
    assert torch.equal(mixed, Sampler()(logits, md()).sampled_token_ids)
    assert mixed[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()
