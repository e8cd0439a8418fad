"""The test-only fault spec (PAGEDLLM_FAULT_INJECTION): its parse, and the sleeps of `slow`."""

import time
from types import SimpleNamespace

import pytest

from pagedllm.worker.fault_injection import ENV, SLOW_STEP_S, FaultInjector


def state(*prompt):
    return SimpleNamespace(req_id="r", token_ids=list(prompt) + [1, 2], num_prompt_tokens=len(prompt))


def test_spec_parsed(monkeypatch):
    monkeypatch.setenv(ENV, "raise:500, slow:503,slow:504:40")
    f = FaultInjector.from_env()
    assert f.triggers == {500: "raise", 503: "slow", 504: "slow"}
    assert f.sleeps == {503: SLOW_STEP_S, 504: 0.04}


@pytest.mark.parametrize("spec", ["slow", "raise:x", "hang:5", "raise:500:40", "slow:503:fast", "slow:1:2:3"])
def test_bad_spec_names_the_variable(monkeypatch, spec):
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(ValueError, match=ENV):
        FaultInjector.from_env()


def test_slow_sleeps_the_longest_held(monkeypatch):
    f = FaultInjector({500: "raise", 503: "slow", 504: "slow"}, {504: 0.2})
    t0 = time.perf_counter()
    f.check([state(7, 8)])  # no trigger in a prompt: no sleep
    assert time.perf_counter() - t0 < 0.1
    t0 = time.perf_counter()
    f.check([state(503), state(9, 504)])
    assert time.perf_counter() - t0 >= 0.2
    with pytest.raises(RuntimeError, match="500"):
        f.check([state(503, 500)])
