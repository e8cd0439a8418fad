"""Speculative decoding's acceptance counters, with vLLM's metric names (no torch: the scheduler
keeps them, the core sends them with its stats)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started. A draft is one request's proposal in one step; position
    i counts the drafts whose token i was accepted (then so were 0..i-1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per draft: the accepted ones plus the bonus (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


class SpecDecodingPrometheus:
    """The counters on /metrics (vLLM's names after the prefix) from the core's running totals,
    and the stats log line's part: acceptance rate and mean acceptance length since the last line."""

    def __init__(self, prefix: str, model_name: str, registry) -> None:
        from prometheus_client import Counter

        labels = ["model_name"]

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, labels, registry=registry).labels(model_name)

        self.counters = {
            "spec_decode_num_drafts": counter("spec_decode_num_drafts", "Speculative drafts verified."),
            "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
            "spec_decode_num_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
        }
        self.per_pos = Counter(
            f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels + ["position"],
            registry=registry,
        )
        self.model_name = model_name
        self.last = SpecDecodingStats()  # totals already counted
        self.logged = SpecDecodingStats()  # totals at the last log line

    def update(self, totals: dict) -> None:
        now = SpecDecodingStats(
            totals["spec_decode_num_drafts"],
            totals["spec_decode_num_draft_tokens"],
            totals["spec_decode_num_accepted_tokens"],
            list(totals["spec_decode_num_accepted_tokens_per_pos"]),
        )
        for name, counter in self.counters.items():
            d = now.as_dict()[name] - self.last.as_dict()[name]
            if d > 0:
                counter.inc(d)
        before = self.last.num_accepted_tokens_per_pos
        for i, n in enumerate(now.num_accepted_tokens_per_pos):
            d = n - (before[i] if i < len(before) else 0)
            if d > 0:
                self.per_pos.labels(self.model_name, str(i)).inc(d)
        self.last = now

    def log_line(self) -> str:
        """'' when nothing was drafted since the last line."""
        now, was = self.last, self.logged
        self.logged = now
        drafts, drafted = now.num_drafts - was.num_drafts, now.num_draft_tokens - was.num_draft_tokens
        if not drafts:
            return ""
        accepted = now.num_accepted_tokens - was.num_accepted_tokens
        return (
            f", SpecDecoding: acceptance rate {100 * accepted / max(drafted, 1):.1f}%, "
            f"mean acceptance length {1 + accepted / drafts:.2f}, drafted {drafted}, accepted {accepted}"
        )
