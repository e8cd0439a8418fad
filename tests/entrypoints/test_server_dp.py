"""Data parallelism on a real model: `pagedllm serve -dp 2` (two engine-core processes behind the
router) answers a batch of concurrent greedy requests exactly as the one-replica offline engine
does, token for token, and both replicas served some of them (/metrics, per replica).

The tiny random model keeps it fast; its word-level tokenizer makes text and token ids one to
one (with skip_special_tokens off, "<unk>", "<s>" and "</s>" are words too)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedllm import LLM, SamplingParams
from server_utils import TINY, tiny_server, wait_idle

NUM_PROMPTS, MAX_TOKENS = 12, 16


def _prompts() -> list[list[int]]:
    """Unrelated prompts of 3 to 80 tokens (no shared prefix: the router balances them by load)."""
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, 512, (int(torch.randint(3, 81, (1,), generator=g)),), generator=g).tolist()
        for _ in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def server():
    srv = tiny_server(256, "-dp", "2", "--max-num-seqs", "8")
    yield srv
    srv.close()


@pytest.mark.timeout(300)
def test_dp2_greedy_equals_one_replica(server):
    prompts = _prompts()
    llm = LLM(TINY, max_model_len=256)
    ref = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    ref_ids = [o.outputs[0].token_ids for o in ref]
    tok = llm.get_tokenizer()
    token_id = {tok.decode([i]): i for i in range(len(tok))}

    aclient = server.async_client()

    async def all_at_once():
        return await asyncio.gather(
            *(
                aclient.completions.create(
                    model=TINY,
                    prompt=p,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True, "skip_special_tokens": False},
                )
                for p in prompts
            )
        )

    outs = asyncio.run(all_at_once())
    got = [[token_id[w] for w in r.choices[0].text.split()] for r in outs]
    assert got == ref_ids
    assert all(r.usage.completion_tokens == MAX_TOKENS for r in outs)
    m = wait_idle(server)
    per_replica = [m.get(f'pagedllm:dp_replica_requests_added{{replica="{i}"}}', 0) for i in range(2)]
    assert sum(per_replica) == NUM_PROMPTS and min(per_replica) >= 1, per_replica


@pytest.mark.timeout(300)
def test_requests_sharing_a_prefix_go_to_the_replica_caching_it(server):
    """One at a time (the replicas equally idle), requests that share a 64-token prefix (4 blocks
    of 16) all go to the replica that cached it: each after the first finds those 64 tokens in
    the prefix cache (on the other replica it would find none), and one replica's count grows by 6."""
    m0 = wait_idle(server)
    before = [m0.get(f'pagedllm:dp_replica_requests_added{{replica="{i}"}}', 0) for i in range(2)]
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 512, (64,), generator=g).tolist()
    client = server.client()
    cached = []
    for i in range(6):
        r = client.completions.create(model=TINY, prompt=prefix + [100 + i, 7, 9], max_tokens=2, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0] + [64] * 5, cached
    m = wait_idle(server)
    added = [m.get(f'pagedllm:dp_replica_requests_added{{replica="{i}"}}', 0) - before[i] for i in range(2)]
    assert sorted(added) == [0, 6], added
