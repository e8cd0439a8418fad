"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer."""

import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer, detokenize_all
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "  leading spaces, trailing tabs\t\t and\nnew\nlines  ",
    "Café crème brûlée, naïve façade, São Paulo, Zürich, Ångström.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 🎉👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 done",
    "Mixed: x² + y² = z², π≈3.14159, ∑∫∂ → ∞; 价格是€12,50 😀!",
    "def f(x):\n    return {'k': [1, 2, 3]}  # code 🐍",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters and 𠜎𠜱𠝹 rare CJK",
]
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tok(tokenizer):  # the default model's (conftest marks its users `model`)
    return tokenizer


FAST = True  # which decoder the tests below run: tokenizers' DecodeStream, or the token window


@pytest.fixture(autouse=True, params=["stream", "window"])
def decoder(request, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "FAST", request.param == "stream")
    return request.param


def detok(tok, prompt_ids, params):
    return IncrementalDetokenizer(tok, list(prompt_ids), params, fast=FAST)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt_ids=(), chunk=1, stop_terminated=False, **kw):
    """Feed ids `chunk` at a time; return (deltas, detokenizer, stop string)."""
    d = detok(tok, prompt_ids, SamplingParams(**kw))
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        new = ids[i : i + chunk]
        last = i + chunk >= len(ids)
        stop = d.update(new, stop_terminated and last)
        finished = stop is not None or last
        deltas.append(d.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return deltas, d, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(tok, text, chunk):
    ids = enc(tok, text)
    expected = tok.decode(ids, skip_special_tokens=True)
    for prompt in ((), enc(tok, PROMPT)):
        deltas, d, stop = stream(tok, ids, prompt, chunk=chunk)
        assert stop is None
        assert "".join(deltas) == expected == d.output_text
        if "\ufffd" not in expected:
            assert not any("\ufffd" in x for x in deltas), deltas


def test_multibyte_chars_span_tokens(tok):
    # Guard that the texts above really exercise split characters.
    ids = enc(tok, "🎉你")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_per_token_window_stays_small(tok, decoder):
    # The decoded window must not grow with the output: constant cost per token.
    ids = enc(tok, " ".join(TEXTS) * 5)
    d = detok(tok, [], SamplingParams())
    assert type(d.decoder).__name__ == ("_StreamDecoder" if decoder == "stream" else "_WindowDecoder")
    for i in ids:
        d.update([i], False)
        if decoder == "window":
            assert len(d.decoder.tokens) - d.decoder.prefix_offset <= 12
        else:
            assert len(d.decoder.pending) <= 4 and len(d.decoder.context) <= 5
    assert d.get_next_output_text(True, False) == tok.decode(ids)


def test_unfinished_character_flushed_at_end(tok):
    ids = enc(tok, "ok 🎉")[:-1]  # drop the emoji's last byte token
    expected = tok.decode(ids)
    assert expected.endswith("\ufffd")
    deltas, d, _ = stream(tok, ids)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in x for x in deltas[:-1])


def test_stop_string_spanning_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    stop_str = "fox jum"
    assert stop_str not in [tok.decode([i]) for i in ids]  # spans tokens
    deltas, d, stop = stream(tok, ids, stop=[stop_str])
    assert stop == stop_str
    assert d.output_text == "".join(deltas) == "The quick brown "
    deltas, d, stop = stream(tok, ids, stop=[stop_str], include_stop_str_in_output=True)
    assert stop == stop_str
    assert d.output_text == "".join(deltas) == "The quick brown fox jum"
    # Once stopped, later tokens add nothing.
    assert d.update(enc(tok, " more"), False) is None
    assert d.output_text == "The quick brown fox jum"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stream_never_emits_partial_stop(tok, chunk):
    # "lazy c" looks like the start of the stop string; it must be held, then released.
    text = "the lazy cat, the lazy crow and the lazy dog slept"
    ids = enc(tok, text)
    deltas, d, stop = stream(tok, ids, chunk=chunk, stop=["lazy dog", "zzz"])
    assert stop == "lazy dog"
    final = "the lazy cat, the lazy crow and the "
    assert d.output_text == final
    sent = ""
    for x in deltas:
        sent += x
        assert final.startswith(sent)  # nothing streamed is ever taken back
    assert sent == final
    # Before the end, at least len("lazy dog") - 1 chars were held back.
    d2 = detok(tok, [], SamplingParams(stop=["lazy dog"]))
    d2.update(enc(tok, "the lazy do"), False)
    assert d2.get_next_output_text(False, True) == "the "
    assert d2.get_next_output_text(False, False) == "the "


def test_earliest_stop_string_wins(tok):
    ids = enc(tok, "alpha beta gamma delta")
    # All in one update: both match; the earlier in the text wins, not the first listed.
    d = detok(tok, [], SamplingParams(stop=["gamma", "beta"]))
    assert d.update(ids, False) == "beta"
    assert d.output_text == "alpha "
    d = detok(tok, [], SamplingParams(stop=["delta", "a g"], include_stop_str_in_output=True))
    assert d.update(ids, False) == "a g"
    assert d.output_text == "alpha beta g"
    _, d, stop = stream(tok, ids, stop=["gamma", "beta"])
    assert stop == "beta" and d.output_text == "alpha "


def test_stop_inside_several_tokens_ends_at_the_completing_token(tok):
    """Several tokens in one update (a verified speculative run): the tokens after the one that
    completes the stop string are counted, for the output processor to drop, as one at a time."""
    ids = enc(tok, "alpha beta gamma delta epsilon")
    upto = len(enc(tok, "alpha beta gamma"))  # "gamma" completes with this many tokens
    for kw in ({}, {"include_stop_str_in_output": True}):
        d = detok(tok, [], SamplingParams(stop=["gam"], **kw))
        assert d.update(ids, False) == "gam" and d.tokens_after_stop == len(ids) - upto
        one = detok(tok, [], SamplingParams(stop=["gam"], **kw))
        used = next(i + 1 for i in range(len(ids)) if one.update(ids[i : i + 1], False))
        assert used == upto and one.output_text == d.output_text and one.tokens_after_stop == 0
    d = detok(tok, [], SamplingParams(stop=["gam"]))  # the last token a stop id too
    assert d.update(ids, True) == "gam" and d.tokens_after_stop == len(ids) - upto


def test_stop_string_respects_min_tokens(tok):
    ids = enc(tok, "stop here, then stop again")
    n_first = len(enc(tok, "stop here,"))
    _, d, stop = stream(tok, ids, stop=["stop"], min_tokens=n_first)
    assert stop == "stop" and d.output_text == "stop here, then "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    ids = enc(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhey 👋")
    assert 1 in ids and 2 in ids
    deltas, d, _ = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) != skip


def test_stop_terminated_eos(tok):
    ids = enc(tok, "Bye now.") + [tok.eos_token_id]
    for skip, include, tail in [(True, False, ""), (True, True, ""), (False, False, ""), (False, True, "<|im_end|>")]:
        _, d, _ = stream(tok, ids, stop_terminated=True, skip_special_tokens=skip, include_stop_str_in_output=include)
        assert d.output_text == "Bye now." + tail, (skip, include)


def test_detokenize_false(tok):
    d = detok(tok, [], SamplingParams(detokenize=False, stop=["a"]))
    assert d.update(enc(tok, "a b c"), False) is None
    assert d.get_next_output_text(True, True) == "" and d.output_text == ""


def test_prompt_ending_mid_character(tok):
    ids = enc(tok, "🎉🎉 yes")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    deltas, d, _ = stream(tok, ids[cut:], prompt_ids=ids[:cut])
    assert "".join(deltas).endswith("🎉 yes")


def test_random_chunks_match_decode(tok):
    rng = random.Random(0)
    ids = enc(tok, "".join(TEXTS))
    d = detok(tok, enc(tok, PROMPT), SamplingParams())
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        d.update(ids[i : i + n], False)
        i += n
        out.append(d.get_next_output_text(i >= len(ids), True))
    assert "".join(out) == detokenize_all(tok, ids)


def test_ids_past_the_vocabulary_add_no_text(tok):
    # A model's logits can be wider than its tokenizer (padded vocabularies): such an id has no
    # text, in the prompt's context or in the output, and must not fail the request's output.
    ids = enc(tok, TEXTS[2])
    past = len(tok) + 7
    deltas, d, stop = stream(tok, ids[:3] + [past] + ids[3:], prompt_ids=[past, *enc(tok, PROMPT)], chunk=1)
    assert stop is None
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=True)


def test_output_processor_drops_tokens_after_a_stop_string(tok):
    """Several tokens in one core output, a stop string completed in their middle: the request's
    token ids and logprobs end at the completing token (the text at the stop string), as when
    the tokens come one a step."""
    from pagedllm.core.scheduler_output import EngineCoreOutput
    from pagedllm.engine.output_processor import OutputKind, OutputProcessor
    from pagedllm.request import Request

    ids = enc(tok, "alpha beta gamma delta epsilon")
    upto = len(enc(tok, "alpha beta gamma"))
    proc = OutputProcessor(tok)
    proc.add_request(Request("r", [1, 2], SamplingParams(stop=["gam"], logprobs=0)), None, OutputKind.FINAL_ONLY)
    entries = [([t], [-0.5], 1) for t in ids]
    outs, to_abort = proc.process_outputs([EngineCoreOutput("r", ids, new_logprobs=entries)])
    done = outs[0].outputs[0]
    assert to_abort == ["r"] and done.finish_reason == "stop" and done.text == "alpha beta "
    assert done.token_ids == ids[:upto] and [list(lp) for lp in done.logprobs] == [[t] for t in ids[:upto]]
    assert done.cumulative_logprob == -0.5 * upto
