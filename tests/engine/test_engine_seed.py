"""--seed: requests without a seed of their own draw from a generator the engine seeds, so the
same engine seed gives the same run and another seed another one (vLLM's behaviour)."""

from pagedllm import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


def run(seed: int) -> list[list[int]]:
    llm = LLM(model="random:tiny", seed=seed, max_model_len=64)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_engine_seed_fixes_unseeded_sampling():
    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
