"""What the server is doing, in Prometheus' text format on a port of its own (`serving.metrics_port`, `/metrics`).

One server process owns the counters (the generation worker reports to it), so prometheus_client's single-process
registry is enough. Names follow Prometheus conventions (`_total` counters, `_seconds` histograms).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("serving_requests", "Requests answered, by route and outcome (ok, bad_request, busy, "
                                "deadline, worker_died, unavailable, internal)", ["route", "outcome"], registry=r)
        self.generated_tokens = Counter("serving_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("serving_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.worker_restarts = Counter("serving_worker_restarts", "Generation workers that died and were replaced",
                                       registry=r)
        self.in_flight = Gauge("serving_requests_in_flight", "Requests handed to the worker, not yet answered",
                               registry=r)
        self.queue_depth = Gauge("serving_queue_depth", "Requests waiting to join the running batch", registry=r)
        self.running_batch = Gauge("serving_running_batch_size", "Sequences in the running batch", registry=r)
        self.ready = Gauge("serving_ready", "1 when a generation worker is ready and the server is not draining",
                           registry=r)
        self.time_to_first_token = Histogram("serving_time_to_first_token_seconds", "From the request's arrival at the "
                                             "server to its first generated token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.time_per_output_token = Histogram("serving_time_per_output_token_seconds", "Decode time per generated "
                                               "token after the first", buckets=TOKEN_BUCKETS, registry=r)
        self.consumer_tokens = Counter("serving_consumer_tokens", "Tokens of answered requests by consumer (the "
                                       "gateway's consumer header; direct = none), model and kind (prompt, "
                                       "completion): the answers' `usage`", ["consumer", "model", "kind"], registry=r)
        self.consumer_requests = Counter("serving_consumer_requests", "Requests by consumer, model and outcome",
                                         ["consumer", "model", "outcome"], registry=r)
        self.request_duration = Histogram("serving_request_duration_seconds", "From arrival to answer, answered "
                                          "requests", buckets=LATENCY_BUCKETS, registry=r)

        self.prefix_queried = Counter("serving_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                                      "workers' prefix caches (answered requests)", registry=r)
        self.prefix_hits = Counter("serving_prefix_cache_hit_tokens", "Prompt tokens found there (not computed): "
                                   "the sum of the answers' usage.prompt_tokens_details.cached_tokens", registry=r)
        self.prefix_evictions = Counter("serving_prefix_cache_evictions", "Blocks the prefix caches evicted (least "
                                        "recently used, to stay within serving.prefix_cache_mb)", registry=r)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def answered(self, route: str, arrived: float, result: dict) -> None:
        """Record a generated answer (`arrived`: time.monotonic() when the server received the request)."""
        tokens = len(result["token_ids"])
        self.requests.labels(route, "ok").inc()
        self.generated_tokens.inc(tokens)
        self.prompt_tokens.inc(result["prompt_tokens"])
        prefix = result.get("prefix_cache")
        if prefix:  # (a worker with prefix caching on: serving/engine/worker.py prefix_counts)
            self.prefix_queried.inc(result["prompt_tokens"])
            self.prefix_hits.inc(result["cached_tokens"])
            self.prefix_evictions.inc(prefix["evictions"])
        if result.get("first_token_at"):
            self.time_to_first_token.observe(max(0.0, result["first_token_at"] - arrived))
            if tokens > 1:
                self.time_per_output_token.observe((result["finished_at"] - result["first_token_at"]) / (tokens - 1))
        self.request_duration.observe(max(0.0, result["finished_at"] - arrived))

    def consumed(self, consumer: str, model: str, usage: dict) -> None:
        """One answered request's `usage` (what its answer reported) for its consumer."""
        self.consumer_requests.labels(consumer, model, "ok").inc()
        self.consumer_tokens.labels(consumer, model, "prompt").inc(usage["prompt_tokens"])
        self.consumer_tokens.labels(consumer, model, "completion").inc(usage["completion_tokens"])

    def refused(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()
