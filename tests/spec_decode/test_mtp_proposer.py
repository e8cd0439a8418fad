"""The MTP proposer (spec_decode/mtp_proposer.py) on a tiny random DeepseekV3ForCausalLM made with
transformers' own class, its next-n layer's random tensors written into the checkpoint under
model.layers.{num_hidden_layers} (models/test_deepseek_mtp.py) and loaded by the engine:

- its draft distribution, each step, equals the MTP equations in plain torch over transformers'
  hidden states (reference_logits) at the request's last position: the right hidden state (the
  target's, before the final norm, per accepted position), the right next token and position,
  after prefill chunks and after verification steps that rejected drafts;
- greedy with MTP equals transformers' greedy, chunked prefill and preemption (both modes)
  forced, drafts were accepted, and no block is left in use;
- a checkpoint without next-n layers is a ValueError naming num_nextn_predict_layers.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.test_deepseek_mtp import add_mtp_layer, reference_logits
from models.test_deepseek_v3 import hf_greedy, make_deepseek_dir, prompts_with_shared_prefix
from pagedllm import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek-v3-mtp")
    model = make_deepseek_dir(out)
    # A final norm of unit weights would make its output and input equivalent to the MTP's hnorm
    # (RMSNorm is scale-free): random weights, so that feeding the normed state fails.
    tensors = load_file(out / "model.safetensors")
    with torch.no_grad():
        model.model.norm.weight.copy_(
            1 + 0.5 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
        )
    tensors["model.norm.weight"] = model.model.norm.weight.detach().clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    extra, block = add_mtp_layer(out, model)
    return out, model, extra, block


def engine(path, **kw):
    return LLM(
        str(path), device="cpu", block_size=4, max_num_batched_tokens=8, dtype="float32", speculative_config=MTP, **kw
    )


@pytest.mark.parametrize("checkpoint", ["random", "bigram"])
def test_draft_distribution_equals_the_mtp_equations(request, checkpoint):
    """random: drafts rejected, the catch-up after rollbacks; bigram (predictable_dir): drafts
    accepted, the catch-up over accepted spans."""
    path, model, extra, block = request.getfixturevalue("mtp_dir" if checkpoint == "random" else "predictable_dir")
    llm = engine(path)
    proposer = llm.llm_engine.core.model_executor.driver_worker.model_runner.spec_decoder.proposer
    seen = []
    original = proposer.propose

    def propose(batch, rows, ks):  # the first draft's logits, from the caught-up output of each row
        for r in rows:
            if r in proposer.last:
                n = int(batch.num_tokens[r])
                seen.append((batch.token_ids_np[r, :n].tolist(), proposer._logits(proposer.last[r][None])[0]))
        return original(batch, rows, ks)

    proposer.propose = propose
    prompt = prompts_with_shared_prefix()[0][0][:13]  # 13 tokens: chunks of 8 + 5
    llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    assert len(seen) >= 4 and stats.num_drafts >= 3, (len(seen), stats)
    if checkpoint == "random":
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2, stats  # steps rolled back
    else:
        assert stats.num_accepted_tokens_per_pos[1] >= 1, stats  # a step accepted both drafts
    for tokens, logits in seen:
        ref, _ = reference_logits(model, block, extra, tokens)  # row i predicts token i + 2
        torch.testing.assert_close(logits, ref[-1], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def predictable_dir(tmp_path_factory):
    """A target whose layers write little into the residual stream (o_proj and down_proj scaled
    by 0.05: near a bigram model), and an MTP module that maps t_{i+1} through the same bigram
    (eh_proj keeps the embedding half, the target's LM head and final norm, its own block scaled
    down too): its drafts are mostly accepted, so verification steps accept several drafts and
    the catch-up runs over accepted spans. Still all random weights, against transformers."""
    out = tmp_path_factory.mktemp("deepseek-v3-mtp-bigram")
    model = make_deepseek_dir(out, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(0.05)
    model.save_pretrained(out, safe_serialization=True)
    extra, block = add_mtp_layer(out, model)
    n, H = model.config.num_hidden_layers, model.config.hidden_size
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(0.05)
    extra.update(
        {
            "eh_proj.weight": torch.cat((torch.eye(H), torch.zeros(H, H)), dim=1),
            "enorm.weight": torch.ones(H),
            "shared_head.head.weight": model.lm_head.weight.detach().clone(),
            "shared_head.norm.weight": model.model.norm.weight.detach().clone(),
        }
    )
    tensors = load_file(out / "model.safetensors")
    mtp = f"model.layers.{n}."
    for name in tensors:
        if name.startswith(mtp) and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * 0.05
    tensors.update({mtp + k: v.contiguous() for k, v in extra.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, model, extra, block


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_with_mtp_equals_transformers(predictable_dir, mode):
    path, model, _, _ = predictable_dir
    prompts = prompts_with_shared_prefix()[0]
    llm = engine(path, num_gpu_blocks=14, preemption_mode=mode, num_cpu_blocks=64)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    core = llm.llm_engine.core
    stats = core.scheduler.spec_decoding_stats
    assert llm.llm_engine.num_preemptions > 0 and stats.num_accepted_tokens > 10, stats
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


def test_checkpoint_without_next_n_layers_is_refused(tmp_path):
    make_deepseek_dir(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(str(tmp_path), device="cpu", speculative_config=MTP)
