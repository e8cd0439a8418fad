"""The offline API on the real model: bad input is a ValueError before anything runs, a seeded
request does not depend on its batch, stop strings / stop ids / min_tokens / n behave."""

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=512)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
        ({"seed": 2**70}, "seed"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_chat_role_rejected(llm):
    with pytest.raises(
        ValueError,
        match=r"messages\[1\]\.role: 'robot' is not a chat role; allowed: system, "
        "developer, user, assistant, tool",
    ):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])


def test_bad_prompts_rejected_before_running(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt has 600 tokens, more than max_model_len \(512\)"):
        llm.generate({"prompt_token_ids": [5] * 600}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt token ids must be integers in"):
        llm.generate({"prompt_token_ids": [1, 2, 10**9]}, SamplingParams(max_tokens=4))
    # One bad prompt among good ones: nothing runs, nothing is left behind.
    with pytest.raises(ValueError):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_bad_engine_args(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope")  # a PathLike is a path like a str
    with pytest.raises(ValueError, match="model must be a name or a path, not int"):
        LLM(123)
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(str(tmp_path), block_sz=4)


def test_bad_request_in_engine_does_not_disturb_others(llm):
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", "The capital of France is", greedy)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", "", greedy)
    with pytest.raises(ValueError):
        engine.add_request("bad2", [1] * 1000, greedy)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.request_id == "good" and final.outputs[0].token_ids == alone


# ------------------------------------------------------------------ behaviour
def test_seeded_request_independent_of_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Tell me a story about a dragon.", seeded, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, max_tokens=8 + 3 * i) for i in range(7)]
    prompts = ["Tell me a story about a dragon."] + [f"Count to {i}:" for i in range(7)]
    batch = llm.generate(prompts, [seeded] + others, use_tqdm=False)
    assert batch[0].outputs[0].text == alone
    assert len(batch[0].outputs[0].token_ids) == 24
    # A different seed gives another text (the seed is really used).
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=24, ignore_eos=True)
    assert llm.generate("Tell me a story about a dragon.", other, use_tqdm=False)[0].outputs[0].text != alone


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    chat = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=100), use_tqdm=False
    )[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in chat.text


def test_stop_strings_and_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0]
    # Stop at a word that the greedy text contains: the text is cut just before it.
    word = full.text.split()[3]
    cut = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[word]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == full.text[: full.text.index(word)]
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[word], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(word) + len(word)]
    # A stop token id: the output ends on it.
    tid = full.token_ids[5]
    by_id = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tid]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tid


def test_min_tokens_defers_eos(llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0].outputs[0]
    longer = llm.chat(
        msgs, SamplingParams(temperature=0, max_tokens=100, min_tokens=len(short.token_ids) + 5), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert 2 not in longer.token_ids[: len(short.token_ids) + 4]


def test_n_and_logprobs(llm):
    out = llm.generate(
        "Hello, my name is", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 8 and len(c.logprobs) == 8
        for tid, pos in zip(c.token_ids, c.logprobs):
            assert tid in pos and len(pos) in (2, 3)  # top 2, plus the sampled token when not among them
            assert all(lp.logprob <= 0 for lp in pos.values())
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


def test_greedy_logprobs_rank_one(llm):
    c = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)[0].outputs[
        0
    ]
    for tid, pos in zip(c.token_ids, c.logprobs):
        assert pos[tid].rank == 1
