"""Structured output offline (LLM.generate on a tiny random-weight model): every kind of
constraint is honoured with n > 1, with prefix-cache hits and across preemption; invalid specs
are ValueErrors naming the field; a grammar still compiling keeps only its own request waiting;
the sampler's bitmask equals xgrammar's own application of it."""

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from tiny_chat_model import make_tiny_chat_model

from pagedllm.sampling_params import ParamError, SamplingParams, StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "tags", "pos"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,4}@[0-9]{3}\.(com|org)"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


def _check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in ("left", "right", "up high"), text


def _params(kind, **kw):
    spec = {"json": SO(json=SCHEMA), "regex": SO(regex=REGEX), "choice": SO(choice=["left", "right", "up high"])}
    return SamplingParams(temperature=1.0, max_tokens=150, structured_outputs=spec[kind], **kw)


@pytest.mark.timeout(600)
def test_n_prefix_caching_and_preemption(model):
    from pagedllm.entrypoints.llm import LLM

    # 20 blocks of 16 tokens for 12 sequences of ~100 tokens (a shared prompt): they cannot all run at once.
    llm = LLM(model, num_gpu_blocks=20, max_model_len=512, seed=0)
    try:
        prompt = "Write one record, please, as the schema says: " * 3
        kinds = ["json", "regex", "choice"]
        params = [_params(k, n=2, seed=i) for i, k in enumerate(kinds)] * 2
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        assert llm.llm_engine.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outs)  # the shared prompt's blocks were hits
        for o, k in zip(outs, kinds * 2):
            assert len(o.outputs) == 2
            for c in o.outputs:
                assert c.finish_reason == "stop", c.text
                _check(k, c.text)
        # Greedy too, and an unconstrained request beside them is untouched by the masks.
        (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        mixed = llm.generate(
            [prompt] * 2, [SamplingParams(temperature=0, max_tokens=8), _params("regex", seed=1)], use_tqdm=False
        )
        assert mixed[0].outputs[0].token_ids == free.outputs[0].token_ids
        _check("regex", mixed[1].outputs[0].text)
        with pytest.raises(ValueError, match="structured_outputs.regex") as e:
            llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="a(b")), use_tqdm=False)
        assert e.value.param == "structured_outputs.regex"
        with pytest.raises(ValueError, match="structured_outputs.grammar"):
            llm.generate(["x"], SamplingParams(structured_outputs=SO(grammar="root ::= nothing")), use_tqdm=False)
        with pytest.raises(ValueError, match="structured_outputs.json"):
            llm.generate(["x"], SamplingParams(structured_outputs=SO(json='{"type": 3}')), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kw, param",
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"grammar": " "}, "structured_outputs.grammar"),
    ],
)
def test_params_validation(kw, param):
    with pytest.raises(ParamError) as e:
        SO(**kw)
    assert e.value.param == param


def test_grammar_compiling_keeps_only_its_request_waiting(model):
    """A request whose grammar is not compiled yet (WAITING_FOR_FSM) is passed over, keeping its
    place; the requests behind it run; it is admitted once the grammar is there."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.engine.llm_engine import load_tokenizer
    from pagedllm.request import Request, RequestStatus
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        KVCacheManager(64, 16, enable_caching=True),
    )
    slow = Request("slow", [5, 6, 7], _params("regex"), eos_token_id=2)
    slow.structured_output_request.compiled = pending = Future()
    fast = Request("fast", [5, 6, 8], SamplingParams(max_tokens=4), eos_token_id=2)
    sched.add_request(slow)
    sched.add_request(fast)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"fast"} and slow.status == RequestStatus.WAITING_FOR_FSM
    assert list(sched.waiting) == [slow]
    pending.set_result(XgrammarBackend(load_tokenizer(model), 512, {2}).compile("regex", REGEX))
    out = sched.schedule()
    assert "slow" in out.num_scheduled_tokens and out.structured_output_request_ids == ["slow"]


def test_bitmask_equals_xgrammar_apply(model):
    """apply_grammar_bitmask (rows matched by request id, logits wider than the tokenizer) against
    xgrammar's own kernel on the same bitmask."""
    import xgrammar as xgr

    from pagedllm.engine.llm_engine import load_tokenizer
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend
    from pagedllm.worker.sampler import apply_grammar_bitmask

    backend = XgrammarBackend(load_tokenizer(model), 512, {2})
    grammars = [
        backend.compile("json", json.dumps(SCHEMA)).new_grammar(),
        backend.compile("regex", REGEX).new_grammar(),
    ]
    grammars[1].accept_tokens(load_tokenizer(model).encode("ab"))
    mask = backend.allocate_bitmask(2)
    for i, g in enumerate(grammars):
        g.fill_bitmask(mask, i)
    logits = torch.randn(3, 512)
    ours = logits.clone()
    # Batch rows: r0 unconstrained, r1 = the regex's request, r2 = the schema's.
    apply_grammar_bitmask(ours, mask.numpy(), ["s", "r"], ["free", "r", "s"])
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref[1:2], mask[1:2])  # r1 takes the regex's row
    xgr.apply_token_bitmask_inplace(ref[2:3], mask[0:1])  # r2 the schema's
    assert torch.equal(ours, ref)
    assert torch.isinf(ours[1:, 347:]).all()  # ids past the tokenizer's vocabulary are never allowed
