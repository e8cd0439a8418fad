"""Test-only faults in the model runner, so that real server processes can be tested failing.

    PAGEDLLM_FAULT_INJECTION="raise:500,reject:501,exit:502,slow:503"

is read once, when a ModelRunner is made. In a step where a scheduled request's prompt
holds the token id: `raise` raises RuntimeError (a bug in the engine: HTTP 500 for that
request), `reject` raises ValueError (the request's own fault: HTTP 400), `exit` ends the
engine-core process at once with os._exit (as a segfault or the OOM killer would), `slow`
sleeps SLOW_STEP_S (a big model's step, so that a test's requests overlap on any machine). The
check runs after the runner's rows were brought in step with the scheduler and before the
forward, so the step fails half done, as a real fault would leave it. Unset: no cost.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Iterable, Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

ENV = "PAGEDLLM_FAULT_INJECTION"
EXIT_CODE = 70   # what an injected `exit` ends the process with
ACTIONS = ("raise", "reject", "exit", "slow")
SLOW_STEP_S = 0.005


class FaultInjector:
    def __init__(self, triggers: dict[int, str]) -> None:
        self.triggers = triggers   # token id -> action

    @classmethod
    def from_env(cls) -> Optional["FaultInjector"]:
        spec = envs.PAGEDLLM_FAULT_INJECTION.strip()
        if not spec:
            return None
        triggers = {}
        for item in spec.split(","):
            action, _, token = item.strip().partition(":")
            if action not in ACTIONS or not token.strip().isdigit():
                raise ValueError(f"{ENV}: {item!r} is not ACTION:TOKEN_ID with ACTION one of "
                                 f"{', '.join(ACTIONS)}")
            triggers[int(token)] = action
        logger.warning("fault injection is on (%s=%s): for tests only", ENV, spec)
        return cls(triggers)

    def check(self, states: Iterable) -> None:
        """Fail (or slow) the step if a scheduled request's prompt holds a trigger token."""
        slow = False
        for state in states:
            hit = self.triggers.keys() & set(state.token_ids[:state.num_prompt_tokens])
            faults = sorted(t for t in hit if self.triggers[t] != "slow")
            slow |= len(faults) < len(hit)
            if not faults:
                continue
            token = faults[0]
            action = self.triggers[token]
            if action == "exit":
                logger.error("fault injection: request %s holds token %d: exiting", state.req_id, token)
                os._exit(EXIT_CODE)
            error = ValueError if action == "reject" else RuntimeError
            raise error(f"injected fault: the prompt holds token {token}")
        if slow:
            time.sleep(SLOW_STEP_S)
