"""Shared by the recurrent-model tests: a random-weight transformers model saved with a
word-level tokenizer (its norms and biases drawn too, so one left unloaded shows), prompts, and
an engine stepped by hand so that a request can arrive while others run."""

import torch

from engine.test_greedy_equality import assert_greedy_equal
from models.test_qwen3 import hf_reference
from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import RequestFailedError
from pagedllm.engine.llm_engine import LLMEngine

VOCAB = 256
MAX_TOKENS = 12
LENGTHS = [1, 6, 19, 41, 70]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_hf_model(path, config_cls, model_cls, vocab=VOCAB, eos_token_id=None, **config):
    from pagedllm.models.random_model import _write_tokenizer

    cfg = config_cls(vocab_size=vocab, bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0, **config)
    torch.manual_seed(0)
    model = model_cls(cfg).float().eval()
    if hasattr(model, "set_experts_implementation"):  # MoE: the plain per-expert loop
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    _write_tokenizer(path, vocab)
    return str(path), model


def prompts(lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run_with_late_arrival(model_dir, early, late, **settings):
    """`early` prompts (priority 1) run a few steps, then `late` ones (priority 0) arrive and
    preempt them where blocks are short -> (outputs by request id, the engine, ids of the
    requests failed by an injected fault)."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, scheduling_policy="priority", **settings))
    for i, p in enumerate(early):
        engine.add_request(f"e{i}", {"prompt_token_ids": p}, GREEDY, arrival_time=float(i), priority=1)
    outs, failed = {}, []

    def step():
        try:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        except RequestFailedError as e:  # a fault injected into a late request's steps
            failed.extend(e.req_ids)

    for _ in range(3):
        step()
    for i, p in enumerate(late):
        engine.add_request(f"l{i}", {"prompt_token_ids": p}, GREEDY, arrival_time=10.0 + i, priority=0)
    while engine.has_unfinished_requests():
        step()
    return outs, engine, failed


def check_late_arrivals_preempt(model_dir, model, label, **settings):
    """Two long early prompts, then two short late ones of higher priority that preempt them
    (16-token steps, 4 sequences): every output equal to transformers', every block back at the
    end -> the outputs. With preemption_mode "swap" (and swap space for all), every preemption
    swaps: a request's attention blocks and recurrent states go to CPU blocks and come back into
    other device blocks, its state not recomputed (it resumes with tokens computed, so its rows
    are not zeroed), and every CPU block is free at the end."""
    early, late = prompts([41, 33]), prompts([19, 6])
    outs, engine, _ = run_with_late_arrival(
        model_dir, early, late, max_num_batched_tokens=16, max_num_seqs=4, **settings
    )
    sched = engine.core.scheduler
    assert sched.num_preemptions > 0
    assert_greedy_equal([outs[r] for r in ("e0", "e1", "l0", "l1")], hf_reference(model, early + late), label)
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks() == kv.block_pool.num_blocks - 1
    if settings.get("preemption_mode") == "swap":
        assert sched.num_swaps == sched.num_preemptions, "every preemption swaps"
        assert len(kv.free_cpu_blocks) == settings["num_cpu_blocks"] - 1 and not kv.req_to_cpu_blocks
    return outs


def check_batch_against_transformers(model_dir, model, label, managers, min_preemptions, **settings):
    """Prompts of LENGTHS in one batch of at most 4, 16 tokens a step (chunked prefill): greedy
    equal to `model`'s, the KV cache's group managers named `managers`, at least min_preemptions
    preemptions, every block back at the end -> the LLM."""
    ids = prompts(LENGTHS)
    refs = hf_reference(model, ids)
    llm = LLM(model_dir, max_num_batched_tokens=16, max_num_seqs=4, **settings)
    manager = llm.llm_engine.core.scheduler.kv_cache_manager
    assert [type(m).__name__ for m in manager.managers] == managers and manager.enable_caching
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, refs, label)
    assert llm.llm_engine.num_preemptions >= min_preemptions
    assert manager.num_free_blocks() == manager.block_pool.num_blocks - 1
    return llm
