"""Prometheus metrics of the server, in a registry of its own (no global state).

Latencies are measured from the worker's timestamps, so they do not include how late the event
loop got round to a message. Inter-token latency is the gap between consecutive streamed chunks
(one engine step; with speculation a chunk may carry several tokens), which is what a client
sees; ``time_per_output_token`` spreads a request's decode time over its tokens.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specdec.metrics import RequestStats

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)

_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Counters and histograms for requests, tokens, latency and speculation, per method."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specdec_requests",
            "Requests by endpoint and outcome (ok, cancelled, timeout, rejected, invalid, error).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specdec_prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.completion_tokens = Counter(
            "specdec_completion_tokens",
            "Generated tokens (including those of requests cancelled midway).",
            registry=r,
        )
        self.decoded_tokens = Counter(
            "specdec_decoded_tokens",
            "Generated tokens counted as each step hands them out, where "
            "specdec_completion_tokens waits for the request's end: rate() of this one is the "
            "live decode throughput, and a load test reads it over a window of its choosing.",
            registry=r,
        )
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds",
            "From request admission (queueing included) to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds",
            "Gap between consecutive streamed chunks of a request (one engine step).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specdec_time_per_output_token_seconds",
            "A request's decode time after its first token divided by its remaining tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "specdec_queue_wait_seconds",
            "Time a request waited for the engine.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "specdec_queue_depth", "Requests waiting for the engine.", registry=r
        )
        self.tau = Histogram(
            "specdec_mean_accepted_tokens",
            "Per request τ: tokens committed per target forward pass.",
            ["method"],
            buckets=_TAU_BUCKETS,
            registry=r,
        )
        self.drafted = Counter(
            "specdec_drafted_tokens", "Draft tokens proposed.", ["method"], registry=r
        )
        self.accepted = Counter(
            "specdec_accepted_tokens",
            "Draft tokens accepted by verification.",
            ["method"],
            registry=r,
        )
        self.forwards = Counter(
            "specdec_target_forwards",
            "Target forward (verification) passes.",
            ["method"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "specdec_acceptance_rate",
            "Accepted / drafted tokens since start.",
            ["method"],
            registry=r,
        )
        self.mean_accepted = Gauge(
            "specdec_tau",
            "τ since start: committed tokens per target forward pass.",
            ["method"],
            registry=r,
        )
        self.batch_size = Histogram(
            "specdec_batch_size",
            "Sequences verified together per target pass (continuous batching).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.draft_length = Histogram(
            "specdec_batch_draft_length",
            "Longest draft the batch budget gave a greedy sequence per step (0: none drafted).",
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16),
            registry=r,
        )
        self._totals = [0, 0, 0, 0]  # drafted, accepted, forwards, committed

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def speculation(self, stats: RequestStats) -> None:
        """Fold one finished (or abandoned) request's speculation counts into the totals."""
        m = self.method
        if stats.target_forwards:
            self.tau.labels(method=m).observe(stats.mean_accepted)
        self.drafted.labels(method=m).inc(stats.drafted_tokens)
        self.accepted.labels(method=m).inc(stats.accepted_tokens)
        self.forwards.labels(method=m).inc(stats.target_forwards)
        t = self._totals
        t[0] += stats.drafted_tokens
        t[1] += stats.accepted_tokens
        t[2] += stats.target_forwards
        t[3] += stats.accepted_tokens + stats.target_forwards
        self.acceptance_rate.labels(method=m).set(t[1] / t[0] if t[0] else 0.0)
        self.mean_accepted.labels(method=m).set(t[3] / t[2] if t[2] else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
