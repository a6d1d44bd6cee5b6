"""The gateway's Prometheus metrics, served at its own `GET /metrics`: declared as data
in `GATEWAY_METRICS` (as the worker's, service/metric_specs.py), under `inflight_gateway_`.

Requests are counted by route and HTTP status once their answer ends; 499 is a client
that left before any answer began (nginx's code for it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.metric_specs import LATENCY_BUCKETS, MetricSpec, build_all

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")
CLIENT_LEFT = 499

GATEWAY_METRICS = (
    MetricSpec(
        "requests",
        "counter",
        "inflight_gateway_requests",
        "HTTP requests answered, by route and status.",
        ("route", "status"),
    ),
    MetricSpec(
        "duration",
        "histogram",
        "inflight_gateway_request_duration_seconds",
        "From a request's arrival to the end of its answer, by route.",
        ("route",),
        buckets=LATENCY_BUCKETS,
        series=tuple((route,) for route in ROUTES[:2]),  # the completions routes
    ),
    MetricSpec(
        "time_to_first_token",
        "histogram",
        "inflight_gateway_time_to_first_token_seconds",
        "Streamed requests: from arrival to the first token sent.",
        buckets=LATENCY_BUCKETS,
    ),
    MetricSpec("in_progress", "gauge", "inflight_gateway_requests_in_progress", "Completions being answered now."),
    MetricSpec("tokens", "counter", "inflight_gateway_completion_tokens", "Completion tokens answered."),
    MetricSpec(
        "cancels",
        "counter",
        "inflight_gateway_cancels",
        "Jobs cancelled by the gateway, by why: the client left (disconnect) or no reply came in time (timeout).",
        ("reason",),
        series=(("disconnect",), ("timeout",)),
    ),
    MetricSpec(
        "resumed",
        "counter",
        "inflight_gateway_resumed_streams",
        "Streamed answers taken up again (Last-Event-ID, or GET /v1/streams/{id}).",
    ),
    MetricSpec(
        "backlog_depth",
        "gauge",
        "inflight_gateway_queue_depth_entries",
        "Jobs in the request stream no worker has taken yet, as last looked up.",
    ),
    MetricSpec(
        "backlog_age",
        "gauge",
        "inflight_gateway_queue_age_seconds",
        "How long the oldest of them has waited, as last looked up.",
    ),
)


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


class GatewayMetrics:
    # One attribute per spec of GATEWAY_METRICS, which `build_all` sets.
    requests: Counter
    duration: Histogram
    time_to_first_token: Histogram
    in_progress: Gauge
    tokens: Counter
    cancels: Counter
    resumed: Counter
    backlog_depth: Gauge
    backlog_age: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        build_all(self, GATEWAY_METRICS, self.registry)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        route = route_label(path)
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)
