"""Test-only faults in the model runner, so that real server processes can be tested failing.

    PAGEDLLM_FAULT_INJECTION="raise:500,reject:501,exit:502,slow:503,slow:504:50"

is read once, when a ModelRunner is made. In a step where a scheduled request's prompt
holds the token id: `raise` raises RuntimeError (a bug in the engine: HTTP 500 for that
request), `reject` raises ValueError (the request's own fault: HTTP 400), `exit` ends the
engine-core process at once with os._exit (as a segfault or the OOM killer would), `slow`
sleeps SLOW_STEP_S, or the milliseconds after a third field (a big model's step, so that a
test's requests overlap, or outlast a stalled client, on any machine). The
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
EXIT_CODE = 70  # what an injected `exit` ends the process with
ACTIONS = ("raise", "reject", "exit", "slow")
SLOW_STEP_S = 0.005


class FaultInjector:
    def __init__(self, triggers: dict[int, str], sleeps: Optional[dict[int, float]] = None) -> None:
        self.triggers = triggers  # token id -> action
        self.sleeps = {t: SLOW_STEP_S for t, a in triggers.items() if a == "slow"} | (sleeps or {})

    @classmethod
    def from_env(cls) -> Optional["FaultInjector"]:
        spec = envs.PAGEDLLM_FAULT_INJECTION.strip()
        if not spec:
            return None
        triggers, sleeps = {}, {}  # sleeps: the `slow` ones given milliseconds
        for item in spec.split(","):
            action, *numbers = item.strip().split(":")
            if (
                action not in ACTIONS
                or not 1 <= len(numbers) <= 1 + (action == "slow")
                or not all(x.strip().isdigit() for x in numbers)
            ):
                raise ValueError(
                    f"{ENV}: {item!r} is not ACTION:TOKEN_ID (slow:TOKEN_ID:MS too) with "
                    f"ACTION one of {', '.join(ACTIONS)}"
                )
            token = int(numbers[0])
            triggers[token] = action
            if len(numbers) == 2:
                sleeps[token] = int(numbers[1]) / 1000
        logger.warning("fault injection is on (%s=%s): for tests only", ENV, spec)
        return cls(triggers, sleeps)

    def check(self, states: Iterable) -> None:
        """Fail (or slow) the step if a scheduled request's prompt holds a trigger token."""
        sleep = 0.0
        for state in states:
            hit = self.triggers.keys() & set(state.token_ids[: state.num_prompt_tokens])
            faults = sorted(t for t in hit if self.triggers[t] != "slow")
            sleep = max([sleep] + [self.sleeps[t] for t in hit if t in self.sleeps])
            if not faults:
                continue
            token = faults[0]
            action = self.triggers[token]
            if action == "exit":
                logger.error("fault injection: request %s holds token %d: exiting", state.req_id, token)
                os._exit(EXIT_CODE)
            error = ValueError if action == "reject" else RuntimeError
            raise error(f"injected fault: the prompt holds token {token}")
        if sleep:
            time.sleep(sleep)
