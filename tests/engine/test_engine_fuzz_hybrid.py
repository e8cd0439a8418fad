"""The workload fuzzer (test_engine_fuzz.py) on two models with recurrent layers: a tiny random
LFM2 (short convolutions + attention: attention blocks and conv-state blocks from one pool) and a
tiny random Mamba2 (every layer recurrent: one state block per request), built as
tests/models/test_lfm2.py and test_mamba2.py build them (there equal to transformers).

The same random mix of requests (arrivals, aborts, n / best_of, beam search, chunked prefill)
under a KV cache small enough that preemption is the normal case: after every case no request,
block or state block is left held, and greedy / seeded requests equal the same request alone on a
roomy engine over the same model. Prefix caching is always on (state snapshots at block
boundaries; the workload's prompts share prefixes) and must hit; swap, where drawn, moves the
states with the attention blocks."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from engine.test_engine_fuzz import Reference, fuzz
from fuzz_workload import VOCAB, cdiv, draw_engine_spec
from models.hybrid_utils import make_hf_model
from models.test_lfm2 import CONFIG as LFM2_CONFIG
from models.test_mamba2 import CONFIG as MAMBA2_CONFIG

CASES = 8  # 2 engine configurations of 4 cases: a few seconds a model
CASES_PER_ENGINE = 4
EOS = 2  # fuzz_workload's vocabulary: "w3".."w511", EOS id 2


def build(kind: str, path):
    """-> (model dir, whether it has attention layers, state blocks per request at a block size)."""
    if kind == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        model_dir, _ = make_hf_model(path, Lfm2Config, Lfm2ForCausalLM, vocab=VOCAB, eos_token_id=EOS, **LFM2_CONFIG)
        # 4 conv layers in 2 state groups; a conv state of 64 x 2 floats over pages of
        # block_size x 2 x 32 floats: 2 blocks at block_size 1.
        return model_dir, 1, lambda block_size: 2 * (2 if block_size == 1 else 1)
    from transformers import Mamba2Config, Mamba2ForCausalLM

    model_dir, _ = make_hf_model(path, Mamba2Config, Mamba2ForCausalLM, vocab=VOCAB, eos_token_id=EOS, **MAMBA2_CONFIG)
    return model_dir, 0, lambda block_size: 1


def spec_drawer(has_attention: int, states):
    """The fuzzer's engine draw (blocks of 1 and 2 tokens spread LFM2's conv states over the K
    and V rows of one or two blocks), a pool of 1 to 2 requests' worth at full length (states
    included; the second engine 4 and 16 blocks for snapshots) and room for at least 4 running
    requests, so the pool runs short; prefix caching on."""

    def spec_of(seed: int, group: int):
        rng = random.Random(f"hybrid-engine-{seed}-{group}")
        spec = draw_engine_spec(rng)
        per_request = has_attention * cdiv(spec.max_model_len, spec.block_size) + states(spec.block_size)
        # The second engine is roomier, so that cached blocks and state snapshots outlive
        # the requests that left them, and prefills in chunks (which end at snapshot boundaries).
        roomy = group > 0
        blocks = 1 + (4 * per_request + 16 if roomy else int(per_request * rng.choice([1, 1.5, 2])))
        return dataclasses.replace(
            spec,
            num_gpu_blocks=blocks,
            max_num_seqs=max(spec.max_num_seqs, 4),
            enable_prefix_caching=True,
            enable_chunked_prefill=spec.enable_chunked_prefill or roomy,
        )

    return spec_of


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["lfm2", "mamba2"])
def test_engine_fuzz_on_a_recurrent_model(request, tmp_path, one_thread, kind):
    seed = request.config.getoption("--fuzz-seed")
    model_dir, has_attention, states = build(kind, tmp_path)
    groups = [(g, list(range(CASES_PER_ENGINE))) for g in range(CASES // CASES_PER_ENGINE)]
    t0 = time.monotonic()
    tally = fuzz(
        seed, groups, Reference(model_dir), model=model_dir, spec_of=spec_drawer(has_attention, states), share=0.8
    )
    print(
        f"\n{kind} fuzz, seed {seed}: {tally.cases} cases in {time.monotonic() - t0:.1f} s, {tally.steps} steps, "
        f"requests {dict(tally.requests)}, preemptions {tally.preemptions}, prefix hits {tally.prefix_hits} "
        f"tokens, ties {tally.ties}; "
        f"refusals {dict(tally.refusals)}"
    )
    if tally.failures:
        pytest.fail(
            f"{len(tally.failures)} of {tally.cases} cases failed:\n" + "\n".join(tally.failures), pytrace=False
        )
    assert tally.requests["served"] >= tally.requests["refused"], f"mostly refused: {dict(tally.requests)}"
    # The default seed's workload hits (a few other seeds' draw no prefix a snapshot covers).
    if seed == 0:
        assert tally.prefix_hits > 0, "no prefix-cache hit: the state snapshots were never used"
    # A state-only model's requests never grow: a short pool holds requests back at admission,
    # and only a late request of higher priority preempts; with attention blocks it is common.
    if has_attention:
        assert tally.preemptions > 0, "the pool never ran short: no preemption exercised"
