"""gym-serve's Prometheus metrics (prometheus_client, one registry per app; served at ``GET /metrics``).

Requests by route template and status, prompt and completion tokens, time to first token, time per
output token after the first, variants loaded (resident) and batch occupancy (rows per decoded batch).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, loaded_variants, max_batch: int) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gym_serve_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("gym_serve_prompt_tokens", "Prompt tokens of accepted completions", registry=r)
        self.completion_tokens = Counter("gym_serve_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("gym_serve_time_to_first_token_seconds", "From an accepted request to its first "
                              "token", buckets=LATENCY, registry=r)
        self.tpot = Histogram("gym_serve_time_per_output_token_seconds", "Between consecutive tokens of a "
                              "request", buckets=LATENCY, registry=r)
        Gauge("gym_serve_variants_loaded", "Variants resident in memory", registry=r).set_function(
            lambda: len(loaded_variants()))
        self.batch = Histogram("gym_serve_batch_occupancy", "Rows decoded together per batch",
                               buckets=sorted({1, 2, 4, 8, 16, 32, 64, max_batch}), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
