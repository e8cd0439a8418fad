"""The MoE layer (models/layers/fused_moe.py) against references written here: the routing
functions against per-token loops (softmax top-k with and without renormalising; DeepSeek-V3's
bias-corrected, group-limited top-k), FusedMoE against a per-token loop over its chosen
experts, its tensor-parallel slices (two ranks' outputs sum to the whole layer's), its weight
loader, and the grouped Triton kernel (under TRITON_INTERPRET=1 on the CPU) against the torch
path."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers.fused_moe import FusedMoE, fused_experts_torch, fused_topk, grouped_topk

E, H, I, K = 8, 32, 20, 2


def ref_softmax_topk(logits, k, renormalize):
    weights, ids = [], []
    for row in logits.tolist():
        m = max(row)
        p = [pow(2.718281828459045, x - m) for x in row]
        p = [x / sum(p) for x in p]
        top = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        w = [p[e] for e in top]
        weights.append([x / sum(w) for x in w] if renormalize else w)
        ids.append(top)
    return torch.tensor(weights), torch.tensor(ids)


def ref_deepseek_topk(logits, k, n_group, topk_group, bias, scale):
    """DeepSeek-V3's rule, one token at a time: sigmoid scores; the bias only chooses; groups
    ranked by the sum of their two best biased scores; top-k inside the best topk_group groups;
    weights = unbiased scores renormalised, times the scaling factor."""
    weights, ids = [], []
    size = logits.shape[1] // n_group
    for row in logits.tolist():
        s = [1 / (1 + pow(2.718281828459045, -x)) for x in row]
        c = [x + b for x, b in zip(s, bias.tolist())]
        group_score = [sum(sorted(c[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        top = sorted(allowed, key=lambda e: -c[e])[:k]
        w = [s[e] for e in top]
        weights.append([scale * x / sum(w) for x in w])
        ids.append(top)
    return torch.tensor(weights), torch.tensor(ids)


def by_id(weights, ids):
    """Sorted by expert id (grouped_topk returns its k experts unordered)."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk(renormalize):
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(0)) * 3
    w, ids = fused_topk(logits, 3, renormalize)
    rw, rids = ref_softmax_topk(logits, 3, renormalize)
    assert torch.equal(ids, rids) and w.dtype == torch.float32
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(50)) == renormalize


def test_grouped_topk_deepseek_v3():
    g = torch.Generator().manual_seed(0)
    T, experts, n_group, topk_group, k, scale = 64, 16, 4, 2, 4, 2.5
    logits = torch.randn(T, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g)
    w, ids = grouped_topk(logits, k, n_group, topk_group, True, bias, scale)
    rw, rids = ref_deepseek_topk(logits, k, n_group, topk_group, bias, scale)
    w, ids = by_id(w, ids)
    rw, rids = by_id(rw, rids)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    # The rule matters on these inputs: plain top-k of the scores, or of the biased scores
    # without the group limit, chooses other experts for some tokens.
    plain = logits.sigmoid().topk(k).indices.sort(-1).values
    ungrouped = (logits.sigmoid() + bias).topk(k).indices.sort(-1).values
    assert not torch.equal(plain, ids) and not torch.equal(ungrouped, ids)
    assert all(len({e // (experts // n_group) for e in row}) <= topk_group for row in ids.tolist())


def make_moe(intermediate=range(I), **kw):
    moe = FusedMoE(E, K, H, intermediate, **kw)
    g = torch.Generator().manual_seed(0)
    full13 = torch.randn(E, 2 * I, H, generator=g) * 0.2  # per expert: gate rows, then up rows
    full2 = torch.randn(E, H, I, generator=g) * 0.2
    for e in range(E):  # through the checkpoint's per-expert matrices
        moe.weight_loader(moe.w13_weight, full13[e, :I], (e, "w1"))
        moe.weight_loader(moe.w13_weight, full13[e, I:], (e, "w3"))
        moe.weight_loader(moe.w2_weight, full2[e], (e, "w2"))
    return moe, full13, full2


def ref_moe(x, full13, full2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):  # the test's plain per-token loop
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = full13[e, :I] @ x[t], full13[e, I:] @ x[t]
            out[t] += w * (full2[e] @ (F.silu(gate) * up))
    return out


def test_fused_moe_equals_per_token_reference():
    moe, full13, full2 = make_moe(renormalize=False)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(37, H, generator=g), torch.randn(37, E, generator=g)
    w, ids = fused_topk(logits, K, False)
    torch.testing.assert_close(moe(x, logits), ref_moe(x, full13, full2, w, ids), rtol=1e-5, atol=1e-5)
    # with only some experts active, and no tokens at all
    ids1 = torch.zeros(5, K, dtype=torch.long)
    ids1[:, 1] = 3
    torch.testing.assert_close(
        moe.apply_experts(x[:5], w[:5], ids1), ref_moe(x[:5], full13, full2, w[:5], ids1), rtol=1e-5, atol=1e-5
    )
    assert moe(x[:0], logits[:0]).shape == (0, H)


def test_tensor_parallel_slices_sum_to_the_whole():
    """Rank r holds intermediate columns [r*I/2, (r+1)*I/2) of every expert (uneven: 20 -> 10/10
    here, 25 -> 12/13 in test_moe_models.py); the all-reduce sums the partial outputs."""
    whole, _, _ = make_moe()
    halves = [make_moe(intermediate=r)[0] for r in (range(0, 9), range(9, I))]  # uneven 9 / 11
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(23, H, generator=g), torch.randn(23, E, generator=g)
    torch.testing.assert_close(halves[0](x, logits) + halves[1](x, logits), whole(x, logits), rtol=1e-5, atol=1e-5)


def test_weight_loader_refuses_bad_shards():
    moe, full13, _ = make_moe()
    with pytest.raises(ValueError, match="expert shard"):
        moe.weight_loader(moe.w13_weight, full13[0, :I], (E, "w1"))
    with pytest.raises(ValueError, match="expert shard"):
        moe.weight_loader(moe.w13_weight, full13[0, :I], "w1")
    with pytest.raises(ValueError, match="does not fit"):
        moe.weight_loader(moe.w13_weight, full13[0, :I, : H - 1], (0, "w1"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(E, E + 1, H, range(I))
    with pytest.raises(ValueError, match="n_group"):
        FusedMoE(E, K, H, range(I), use_grouped_topk=True, num_expert_group=3, topk_group=1)


def test_grouped_routing_in_the_layer_uses_the_gates_bias():
    """DeepSeek's gate owns e_score_correction_bias; FusedMoE routes with it but does not
    register it as its own parameter (it would be named, and loaded, twice)."""
    bias = torch.nn.Parameter(torch.randn(E), requires_grad=False)
    moe = FusedMoE(
        E,
        K,
        H,
        range(I),
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        scoring_func="sigmoid",
        e_score_correction_bias=bias,
        routed_scaling_factor=2.0,
    )
    assert {n for n, _ in moe.named_parameters()} == {"w13_weight", "w2_weight"}
    logits = torch.randn(9, E)
    w, ids = moe.select_experts(logits)
    rw, rids = ref_deepseek_topk(logits, K, 4, 2, bias, 2.0)
    assert torch.equal(by_id(w, ids)[1], by_id(rw, rids)[1])


def test_expert_params_mapping_names():
    m = FusedMoE.make_expert_params_mapping(12, "w1", "w2", "w3")
    assert len(m) == 36 and (".experts.w13_", ".experts.11.w3.", (11, "w3")) in m
    assert (".experts.w2_", ".experts.0.w2.", (0, "w2")) in m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_grouped_kernel_equals_torch_path(dtype):
    """On a GPU (every dtype), or under the interpreter on the CPU (bf16 only on a GPU): the two
    grouped launches equal the torch path, with experts that get no token, one token, and more
    than a BLOCK_M of tokens."""
    pytest.importorskip("triton")
    import os

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        # Triton 3.9's interpreter keeps bf16 as uint16 and its tl.dot miscomputes; a GPU runs it.
        pytest.skip("no CUDA device (the CPU interpreter cannot run bf16 tl.dot)")
    assert device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets it without CUDA"
    from pagedllm.models.layers.fused_moe_triton import align_block_size, fused_experts_triton

    moe, _, _ = make_moe(renormalize=True)
    moe = moe.to(device, dtype)
    g = torch.Generator().manual_seed(3)
    T = 21
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids = torch.randint(0, 5, (T, K), generator=g)  # experts 5..7 get no token
    ids[:, 0] = torch.where(torch.arange(T) < 18, 0, ids[:, 0])  # expert 0: 18 rows > BLOCK_M 16
    ids[0, 1], ids[1:, 1] = 6, ids[1:, 1].clamp(1, 4)  # expert 6: one token
    ids, w = ids.to(device), torch.rand(T, K, generator=g).to(device)
    sorted_ids, expert_ids = align_block_size(ids, E, 16)
    valid = sorted_ids[sorted_ids < T * K]
    assert sorted(valid.tolist()) == list(range(T * K))  # every assignment once
    assert torch.equal(ids.reshape(-1)[valid.long()], expert_ids.repeat_interleave(16)[sorted_ids < T * K].long())
    # the reference in float32 from the same (rounded) weights
    ref = fused_experts_torch(
        x.float(), moe.w13_weight.float(), moe.w2_weight.float(), w, ids, lambda h: F.silu(h[:, :I]) * h[:, I:]
    )
    ours = fused_experts_triton(x, moe.w13_weight, moe.w2_weight, w, ids)
    assert ours.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # 16-bit: activations rounded between the matmuls
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)
