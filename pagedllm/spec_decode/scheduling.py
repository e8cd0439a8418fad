"""The scheduler's part of speculation: drafts are tokens like any other, within the budget."""

from __future__ import annotations

from typing import Callable


def trim_spec_tokens(unit: list, budget: int, num_tokens_to_compute: Callable) -> None:
    """Cut the draft tokens of a unit's requests (in order) so that each request's tokens
    still fit the step's token budget: a draft is optional, the real tokens are not. A
    request whose real tokens do not fit (a prefill chunk) keeps no draft."""
    for request in unit:
        if not request.spec_token_ids:
            budget -= num_tokens_to_compute(request)
            continue
        need = num_tokens_to_compute(request) - len(request.spec_token_ids)  # without the drafts
        keep = max(min(len(request.spec_token_ids), budget - need), 0)
        del request.spec_token_ids[keep:]
        budget -= need + keep
