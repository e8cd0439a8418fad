"""Per-phase wall time of engine steps, for `pagedllm bench latency --profile`.

The engine marks the end of each phase of a step (schedule, prepare inputs, forward,
sample, ...); the time since the previous mark is charged to that phase. Off by default:
a disabled mark is one attribute test, so the hot path pays nothing measurable.
"""

from __future__ import annotations

import time

# Phases in step order; "forward" is the model (embedding, layers, LM head of the sampled
# rows); everything else is engine overhead.
PHASES = ("schedule", "prepare_inputs", "forward", "sample", "runner_update", "scheduler_update", "output_processing")
MODEL_PHASES = ("forward",)


class StepProfiler:
    def __init__(self) -> None:
        self.enabled = False
        self.steps: list[dict[str, float]] = []  # one {phase: seconds} per step
        self._cur: dict[str, float] = {}
        self._last = 0.0
        self._tokens = 0

    def start(self) -> None:
        self.enabled = True
        self.steps = []

    def stop(self) -> list[dict[str, float]]:
        self.enabled = False
        return self.steps

    def begin_step(self) -> None:
        if self.enabled:
            self._cur = {"num_tokens": 0.0, "num_reqs": 0.0}
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the last mark (or begin_step) to `phase`."""
        if self.enabled:
            now = time.perf_counter()
            self._cur[phase] = self._cur.get(phase, 0.0) + now - self._last
            self._last = now

    def note_batch(self, num_tokens: int, num_reqs: int) -> None:
        if self.enabled:
            self._cur["num_tokens"] = float(num_tokens)
            self._cur["num_reqs"] = float(num_reqs)

    def end_step(self) -> None:
        if self.enabled and self._cur.get("num_tokens"):
            self.steps.append(self._cur)
        self._cur = {}


PROFILER = StepProfiler()


def summarize(steps: list[dict[str, float]]) -> dict:
    """Mean ms per step of each phase, its share of the step, and the engine overhead (all
    but the model phases) as a share of the step."""
    n = len(steps)
    if n == 0:
        return {"steps": 0, "phases": {}, "step_ms": 0.0, "overhead_pct": 0.0}
    means = {p: sum(s.get(p, 0.0) for s in steps) / n for p in PHASES}
    total = sum(means.values())
    model = sum(means[p] for p in MODEL_PHASES)
    return {
        "steps": n,
        "step_ms": 1e3 * total,
        "phases": {p: {"ms": 1e3 * t, "pct": 100 * t / total if total else 0.0} for p, t in means.items()},
        "overhead_pct": 100 * (total - model) / total if total else 0.0,
        "mean_tokens": sum(s["num_tokens"] for s in steps) / n,
        "mean_reqs": sum(s["num_reqs"] for s in steps) / n,
    }
