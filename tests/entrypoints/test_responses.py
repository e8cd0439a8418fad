"""/v1/responses through the official openai client against a real `pagedllm serve` (the shared
tiny random-model server): `responses.create` and `responses.stream` give, greedy, the text of
transformers' greedy generate on the same weights and the same chat prompt (and the text that
/v1/chat/completions gives), with the Responses event sequence and usage; fields a stateless
server cannot honour are 400s naming them."""

from __future__ import annotations

import openai
import pytest
from greedy_utils import TIE_EPS, hf_greedy
from server_utils import TINY, TINY_CHAT_TEMPLATE

INSTRUCTIONS = "w12 w400 w33"
QUESTION = "w77 w8 w9"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
MAX = 12


@pytest.fixture(scope="module")
def server(tiny_shared_server):
    return tiny_shared_server


@pytest.fixture(scope="module")
def chat_reference(client):
    """(text, usage): transformers' greedy answer to MESSAGES, which the chat endpoint gives too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.random_model import random_model_dir

    path = random_model_dir(TINY)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        MESSAGES, chat_template=TINY_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ((out, gaps),) = hf_greedy(AutoModelForCausalLM.from_pretrained(path).eval(), [list(ids)], MAX)
    assert min(gaps) > TIE_EPS, "a numerical tie in the reference: choose other words"
    # The answer's text continues the prompt's (as vLLM's detokenizer: here a leading space).
    prompt_text = tok.decode(ids, skip_special_tokens=True)
    text = tok.decode(list(ids) + out, skip_special_tokens=True)[len(prompt_text) :]
    r = client.chat.completions.create(model=None, messages=MESSAGES, temperature=0, max_tokens=MAX)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(out)
    return text, r.usage


def test_create_matches_chat(client, chat_reference):
    text, usage = chat_reference
    r = client.responses.create(
        model=None, instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=MAX
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.total_tokens
    # Stopped by max_output_tokens (the chat reference ran for as long): incomplete, saying why.
    if usage.completion_tokens == MAX:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # The same conversation as message items with input_text parts.
    r2 = client.responses.create(
        model=None,
        temperature=0,
        max_output_tokens=MAX,
        input=[
            {"role": "system", "content": INSTRUCTIONS},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
    )
    assert r2.output_text == text


def test_stream_matches_chat(client, chat_reference):
    text, usage = chat_reference
    with client.responses.stream(
        model=None, instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=MAX
    ) as stream:
        events = list(stream)
    # As OpenAI's API: an answer cut by max_output_tokens ends with response.incomplete (the
    # helper's get_final_response() wants response.completed), else response.completed.
    final = events[-1].response
    types = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[:4] == head and types[-4:-1] == tail, types
    assert types[-1] == ("response.incomplete" if usage.completion_tokens == MAX else "response.completed")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and types[4:-4] == ["response.output_text.delta"] * len(deltas)
    assert "".join(e.delta for e in deltas) == text == events[-4].text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == usage.completion_tokens and final.status == events[-1].type[9:]


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), "text.format"),
        (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]), "input"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
            "input[0].content[0]",
        ),
        (dict(input=[{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]), "input[1].role"),
    ],
)
def test_refused_with_400(client, kwargs, param):
    kwargs = {"input": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=None, **kwargs)
    assert e.value.body["param"] == param, e.value.body


def test_store_previous_response_get_delete(client, server):
    """store: true keeps the response; previous_response_id carries its conversation (the answer
    equals chat's on the whole conversation, greedy); GET returns it, DELETE forgets it (404)."""
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="Say a colour.", max_output_tokens=6, temperature=0, store=True)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=model,
        input="And another.",
        max_output_tokens=6,
        temperature=0,
        previous_response_id=first.id,
        store=False,
    )
    chat = client.chat.completions.create(
        model=model,
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "user", "content": "Say a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another."},
        ],
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    assert not second.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)  # not stored
    with client.responses.stream(
        model=model, input="And another.", max_output_tokens=6, temperature=0, previous_response_id=first.id, store=True
    ) as stream:
        streamed = list(stream)[-1].response  # response.incomplete at 6 tokens (no get_final_response)
    assert streamed.output_text == second.output_text
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    client.responses.delete(first.id)
    for call in (
        lambda: client.responses.retrieve(first.id),
        lambda: client.responses.create(model=model, input="x", previous_response_id=first.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert first.id in e.value.body["message"]


@pytest.mark.timeout(600)  # may start the shared default server
def test_store_is_ignored_unless_the_server_keeps_responses(default_server):
    """As vLLM: without PAGEDLLM_ENABLE_RESPONSES_API_STORE (the default server has none), store
    (true by default, as OpenAI's) is ignored: nothing is kept, and the 404 says how to keep it."""
    client = default_server.client()
    r = client.responses.create(model=client.models.list().data[0].id, input="Hi", max_output_tokens=2)
    assert r.store is False
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.create(model=None, input="x", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "PAGEDLLM_ENABLE_RESPONSES_API_STORE" in e.value.body["message"]
