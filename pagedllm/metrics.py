"""Prometheus metrics of the server (served on /metrics) and the periodic stats log line.

Latencies are observed in the API server process as outputs arrive from the engine core
(one observation per sequence: n > 1 counts each of its n sequences); the scheduler's state
(running / waiting requests, KV-cache usage, preemptions) comes from the core's stats,
which it sends after every step and after every abort.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagedllm.spec_decode.metrics import SpecDecodingPrometheus

disable_created_metrics()  # no *_created series: counters and histograms only

logger = logging.getLogger("pagedllm.server")

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TOKEN_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

FINISH_REASONS = ("stop", "length", "abort")


DEFAULT_METRICS_PREFIX = "pagedllm"


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        registry: Optional[CollectorRegistry] = None,
        prefix: str = DEFAULT_METRICS_PREFIX,
        max_lora: Optional[int] = None,
    ) -> None:
        """prefix: the series' namespace (`--metrics-prefix vllm`: the names vLLM's dashboards
        query, which these mirror; see examples/grafana/README.md)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist(
            "time_to_first_token_seconds", "Time to first token (arrival to first output token).", _LATENCY_BUCKETS
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per finished sequence.",
            _TOKEN_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Time between two successive outputs of a sequence.", _TOKEN_BUCKETS
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "End-to-end latency of a sequence (arrival to finish).", _LATENCY_BUCKETS
        )
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS)
        self.running = gauge("num_requests_running", "Sequences running in the engine core.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting in the engine core.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV-cache blocks in use.")
        self.kv_num_blocks = gauge("kv_cache_num_blocks", "KV-cache blocks in all (the null block included).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions in the engine core.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start (0 to 1).")
        # vLLM's names; here the encoder cache of image features (an item: one image a request needs).
        self.mm_queries = counter(
            "mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items (images looked up in the encoder cache).",
        )
        self.mm_hits = counter(
            "mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items (images that needed no encoder run).",
        )
        fin = Counter(
            f"{prefix}:request_success",
            "Finished sequences, by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.finished = {reason: fin.labels(model_name, reason) for reason in FINISH_REASONS}
        # Data parallelism: where the router sent the requests (one series per replica).
        self.replica_added = Gauge(
            f"{prefix}:dp_replica_requests_added",
            "Requests (and beam searches) added to each data-parallel replica.",
            labels + ["replica"],
            registry=r,
        )
        self.rejected = Counter(
            f"{prefix}:request_rejected", "Requests refused (overload, engine dead).", labels + ["reason"], registry=r
        )
        # --enable-lora: vLLM's info gauge, the time of the last update labelled with the adapters
        # running and waiting (comma-separated names) and max_lora.
        self.lora_info = (
            None
            if max_lora is None
            else Gauge(
                f"{prefix}:lora_requests_info",
                "Running stats on LoRA requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=r,
            )
        )
        self.max_lora = max_lora
        self.spec_decoding = SpecDecodingPrometheus(prefix, model_name, r)
        self._last_preemptions = 0
        self.core_stats: dict = {
            "running": 0,
            "waiting": 0,
            "kv_usage": 0.0,
            "used_blocks": 0,
            "num_blocks": 0,
            "preemptions": 0,
            "num_added": 0,
        }
        # For the log line.
        self._num_prompt = 0
        self._num_gen = 0

    # ------------------------------------------------------------ updates
    def update_core_stats(self, s: dict) -> None:
        self.core_stats = s
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.kv_usage.set(s["kv_usage"])
        self.kv_used_blocks.set(s["used_blocks"])
        self.kv_num_blocks.set(s["num_blocks"])
        d = s["preemptions"] - self._last_preemptions
        if d > 0:
            self.preemptions.inc(d)
        self._last_preemptions = s["preemptions"]
        q, h = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        for counter, total, last in (
            (self.prefix_queries, q, "_last_queries"),
            (self.prefix_hits, h, "_last_hits"),
            (self.mm_queries, s.get("mm_cache_queries", 0), "_last_mm_queries"),
            (self.mm_hits, s.get("mm_cache_hits", 0), "_last_mm_hits"),
        ):
            if total > getattr(self, last, 0):
                counter.inc(total - getattr(self, last, 0))
            setattr(self, last, total)
        self.prefix_hit_rate.set(h / q if q else 0.0)
        if self.lora_info is not None:
            self.lora_info.labels(
                str(self.max_lora),
                ",".join(s.get("waiting_lora_adapters") or ()),
                ",".join(s.get("running_lora_adapters") or ()),
            ).set_to_current_time()
        if s.get("spec_decoding"):
            self.spec_decoding.update(s["spec_decoding"])
        for i, rs in enumerate(s.get("replicas") or ()):
            if rs:
                self.replica_added.labels(self.model_name, str(i)).set(rs.get("num_added", 0))

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)
        self._num_prompt += n

    def add_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self._num_gen += n

    def finish(
        self,
        reason: Optional[str],
        arrival: float,
        first: Optional[float],
        last: Optional[float],
        num_tokens: int,
        now: float,
    ) -> None:
        self.finished.get(reason or "abort", self.finished["abort"]).inc()
        if reason == "abort":
            return
        self.e2e.observe(max(now - arrival, 0.0))
        if first is not None and last is not None and num_tokens > 1:
            self.tpot.observe(max(last - first, 0.0) / (num_tokens - 1))

    def take_token_counts(self) -> tuple[int, int]:
        p, g = self._num_prompt, self._num_gen
        self._num_prompt = self._num_gen = 0
        return p, g


class StatLogger:
    """One line every `interval` seconds while the engine is busy (or just was)."""

    def __init__(self, metrics: EngineMetrics, interval: float = 5.0) -> None:
        self.metrics = metrics
        self.interval = interval
        self.last = time.monotonic()

    def log(self) -> Optional[str]:
        now = time.monotonic()
        dt = max(now - self.last, 1e-9)
        self.last = now
        p, g = self.metrics.take_token_counts()
        s = self.metrics.core_stats
        if not (p or g or s["running"] or s["waiting"]):
            return None
        line = (
            f"Running: {s['running']} reqs, Waiting: {s['waiting']} reqs, "
            f"KV cache usage: {100 * s['kv_usage']:.1f}%, "
            f"Prompt throughput: {p / dt:.1f} tokens/s, Generation throughput: {g / dt:.1f} tokens/s"
            + self.metrics.spec_decoding.log_line()
        )
        logger.info(line)
        return line
