"""The gateway's Prometheus metrics, served at its own `GET /metrics`.

Naming as the worker's (service/metrics.py), under `inflight_gateway_`. Requests are
counted by route and HTTP status once their answer ends; 499 is a client that left
before any answer began (nginx's code for it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.metrics import LATENCY_BUCKETS

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")
CLIENT_LEFT = 499


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "inflight_gateway_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "inflight_gateway_request_duration_seconds",
            "From a request's arrival to the end of its answer, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "inflight_gateway_time_to_first_token_seconds",
            "Streamed requests: from arrival to the first token sent.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_progress = Gauge(
            "inflight_gateway_requests_in_progress", "Completions being answered now.", registry=registry
        )
        self.tokens = Counter("inflight_gateway_completion_tokens", "Completion tokens answered.", registry=registry)
        self.cancels = Counter(
            "inflight_gateway_cancels",
            "Jobs cancelled by the gateway, by why: the client left (disconnect) or no reply came in time (timeout).",
            ["reason"],
            registry=registry,
        )
        self.resumed = Counter(
            "inflight_gateway_resumed_streams",
            "Streamed answers taken up again (Last-Event-ID, or GET /v1/streams/{id}).",
            registry=registry,
        )
        self.backlog_depth = Gauge(
            "inflight_gateway_queue_depth_entries",
            "Jobs in the request stream no worker has taken yet, as last looked up.",
            registry=registry,
        )
        self.backlog_age = Gauge(
            "inflight_gateway_queue_age_seconds",
            "How long the oldest of them has waited, as last looked up.",
            registry=registry,
        )
        for reason in ("disconnect", "timeout"):
            self.cancels.labels(reason)
        for route in ROUTES[:2]:
            self.duration.labels(route)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        route = route_label(path)
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)
