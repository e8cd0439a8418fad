"""Every sampling field the server takes does what it does offline: for each of
top_k, min_p, the presence / frequency / repetition penalties, logit_bias, stop_token_ids and
seed, the server's output equals the offline LLM's for the same parameters on the same model,
token for token (seeded sampling included), and the field changes the output compared with the
same request without it, in the way the field means (top_k: every token within the top k...).

The tiny random model (random:tiny): its near-uniform distributions make a seeded sample differ
as soon as anything in the sampling changes, and its greedy output repeats tokens, which every
penalty visibly ends. A real `pagedllm serve` on 127.0.0.1, the official openai client."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagedllm import LLM, SamplingParams
from server_utils import TINY, TINY_CHAT_TEMPLATE, TINY_SERVER_MAX_MODEL_LEN

MODEL = TINY
MAX_MODEL_LEN = TINY_SERVER_MAX_MODEL_LEN  # the offline LLM as the shared server
MAX_TOKENS = 16
TEMPLATE = TINY_CHAT_TEMPLATE
PROMPTS = [[5, 17, 33, 99, 100, 7], [300, 301, 302], [9, 9, 9, 9]]
SAMPLED = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Fields the openai client takes as its own arguments; the rest (vLLM's) go in extra_body.
OPENAI_FIELDS = {
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "n",
    "best_of",
    "logprobs",
}

CLIENT_TIMEOUT = 30  # seconds: the tiny model answers fast


@pytest.fixture(scope="module")
def server(tiny_shared_server):
    return tiny_shared_server


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20)


def _split(fields: dict) -> tuple[dict, dict]:
    own = {k: v for k, v in fields.items() if k in OPENAI_FIELDS}
    if "logit_bias" in own:
        own["logit_bias"] = {str(t): b for t, b in own["logit_bias"].items()}
    return own, {k: v for k, v in fields.items() if k not in OPENAI_FIELDS}


def served(client, prompt, **fields) -> list[tuple]:
    """(text, finish_reason, stop_reason) of each choice of a completion of token-id `prompt`."""
    own, extra = _split(fields)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=extra, **own)
    return [(c.text, c.finish_reason, c.stop_reason) for c in sorted(r.choices, key=lambda c: c.index)]


def offline(llm, prompt, **fields):
    """The offline outputs (with the top-5 logprobs, which change no sampling) of the same request."""
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=5, **fields)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs


def as_served(outputs) -> list[tuple]:
    return [(o.text, o.finish_reason, o.stop_reason) for o in outputs]


def _repeats(ids) -> int:
    return len(ids) - len(set(ids))


def _top_k_holds(out, k) -> bool:
    return all(pos[t].rank <= k for t, pos in zip(out.token_ids, out.logprobs))


def _min_p_holds(out, p) -> bool:
    """Every sampled token's probability is at least p times the most likely one's (temperature 1)."""
    return all(
        pos[t].logprob >= max(lp.logprob for lp in pos.values()) + math.log(p) - 1e-5
        for t, pos in zip(out.token_ids, out.logprobs)
    )


# (base request, the field, does the output show the field's meaning?)
CASES = {
    "top_k": (SAMPLED, {"top_k": 3}, lambda out: _top_k_holds(out, 3)),
    "min_p": (SAMPLED, {"min_p": 0.9}, lambda out: _min_p_holds(out, 0.9)),
    "presence_penalty": (GREEDY, {"presence_penalty": 0.5}, lambda out: _repeats(out.token_ids) == 0),
    "frequency_penalty": (GREEDY, {"frequency_penalty": 0.5}, lambda out: _repeats(out.token_ids) == 0),
    "repetition_penalty": (GREEDY, {"repetition_penalty": 1.5}, lambda out: _repeats(out.token_ids) == 0),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_field_equals_offline_and_changes_output(llm, client, name):
    base, field, shows = CASES[name]
    for prompt in PROMPTS:
        (without,) = offline(llm, prompt, **base)
        (with_field,) = offline(llm, prompt, **base, **field)
        assert served(client, prompt, **base, **field) == as_served([with_field]), (name, prompt)
        assert served(client, prompt, **base) == as_served([without]), prompt
        assert with_field.token_ids != without.token_ids, (name, prompt)
        assert shows(with_field) and not shows(without), (name, prompt, with_field.token_ids, without.token_ids)


@pytest.mark.timeout(120)
def test_logit_bias_equals_offline_and_changes_output(llm, client):
    for prompt in PROMPTS:
        (without,) = offline(llm, prompt, **SAMPLED)
        banned = {t: -100.0 for t in without.token_ids[:4]}
        (with_ban,) = offline(llm, prompt, **SAMPLED, logit_bias=banned)
        assert not set(with_ban.token_ids) & set(banned), (prompt, with_ban.token_ids)
        assert served(client, prompt, **SAMPLED, logit_bias=banned) == as_served([with_ban]), prompt
        (forced,) = offline(llm, prompt, **SAMPLED, logit_bias={42: 100.0})
        assert forced.token_ids == [42] * MAX_TOKENS
        assert served(client, prompt, **SAMPLED, logit_bias={42: 100.0}) == as_served([forced])


@pytest.mark.timeout(120)
def test_stop_token_ids_and_min_tokens_equal_offline(llm, client):
    for prompt in PROMPTS:
        (without,) = offline(llm, prompt, **SAMPLED)
        stop_id = without.token_ids[5]
        end = without.token_ids.index(stop_id) + 1
        (with_stop,) = offline(llm, prompt, **SAMPLED, stop_token_ids=[stop_id])
        assert with_stop.token_ids == without.token_ids[:end]
        assert (with_stop.finish_reason, with_stop.stop_reason) == ("stop", stop_id)
        assert served(client, prompt, **SAMPLED, stop_token_ids=[stop_id]) == as_served([with_stop]), prompt
        # min_tokens masks the stop id for the first end + 1 tokens: the same sample up to it, then past it
        (held,) = offline(llm, prompt, **SAMPLED, stop_token_ids=[stop_id], min_tokens=end + 1)
        assert held.token_ids[: end - 1] == without.token_ids[: end - 1]
        assert stop_id not in held.token_ids[: end + 1] and len(held.token_ids) > end + 1
        assert served(client, prompt, **SAMPLED, stop_token_ids=[stop_id], min_tokens=end + 1) == as_served([held])


@pytest.mark.timeout(120)
def test_seed_equals_offline_alone_in_a_batch_and_per_sample(llm, server, client):
    prompt = PROMPTS[0]
    sampled = {"temperature": 1.0, "ignore_eos": True}
    ref = {s: as_served(offline(llm, prompt, seed=s, **sampled)) for s in range(4)}
    assert len({tuple(v) for v in ref.values()}) == 4, "different seeds gave the same sample"
    assert served(client, prompt, seed=0, **sampled) == ref[0]
    assert served(client, prompt, seed=0, **sampled) == ref[0]  # again: the seed, not the server's state

    async def concurrently():  # one batch on the server: each seeded request as it is alone
        aclient = server.async_client(timeout=60)
        own, extra = _split(sampled)
        rs = await asyncio.gather(
            *(
                aclient.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, seed=s, extra_body=extra, **own
                )
                for s in range(4)
            )
        )
        await aclient.close()
        return [[(c.text, c.finish_reason, c.stop_reason) for c in r.choices] for r in rs]

    assert asyncio.run(concurrently()) == [ref[s] for s in range(4)]
    # n samples: sample i is seeded with seed + i, offline and in the server
    many = as_served(offline(llm, prompt, seed=0, n=3, **sampled))
    assert many == [ref[0][0], ref[1][0], ref[2][0]]
    assert served(client, prompt, seed=0, n=3, **sampled) == many


@pytest.mark.timeout(120)
def test_chat_with_every_field_equals_offline(llm, client):
    messages = [{"role": "user", "content": "w5 w17 w33 w99"}]
    fields = {
        "temperature": 0.9,
        "seed": 99,
        "top_k": 50,
        "min_p": 0.05,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {7: -100.0, 8: 3.0},
        "stop_token_ids": [11],
        "ignore_eos": True,
    }
    (ref,) = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, **fields), chat_template=TEMPLATE, use_tqdm=False)
    (plain,) = llm.chat(
        messages,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=99, ignore_eos=True),
        chat_template=TEMPLATE,
        use_tqdm=False,
    )
    assert ref.outputs[0].token_ids != plain.outputs[0].token_ids
    own, extra = _split(fields)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, extra_body=extra, user="tester", **own
    )
    c = r.choices[0]
    assert (c.message.content, c.finish_reason, c.stop_reason) == (
        ref.outputs[0].text,
        ref.outputs[0].finish_reason,
        ref.outputs[0].stop_reason,
    )
