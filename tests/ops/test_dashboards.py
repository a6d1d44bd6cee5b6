"""The Grafana dashboard as code: the committed JSON is what the generator writes, Grafana's
typed dashboard model keeps every field of it, and every panel queries only metrics a worker's
(or a gateway's) registry exports (so a renamed metric cannot leave a panel silently empty).
tests/service/test_observability.py runs the same queries against a real Prometheus scraping a real
worker.

The generator builds with grafana-foundation-sdk, a `dev` dependency: without it the tests
that run the generator or the SDK's model skip, and the others read the committed JSON."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from service.gateway.metrics import GatewayMetrics
from service.metrics import Metrics
from workers.api import FinalEvent, FinishReason, Timings, Usage
from workers.engine import EngineStats, StepRecord
from workers.plan import Census

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "ops" / "grafana" / "dashboards" / "inflight.json"
needs_sdk = pytest.mark.skipif(
    importlib.util.find_spec("grafana_foundation_sdk") is None,
    reason="grafana-foundation-sdk is not installed (pip install -e '.[dev]' brings it)",
)

# Series Prometheus makes itself rather than scraping them from a worker.
PROMETHEUS_OWN = {"up"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


def exported_series_names() -> set[str]:
    """Every series name a worker's or a gateway's registry exports, once each metric has seen data."""
    metrics = Metrics()
    step = StepRecord(
        num_prefill_tokens=12,
        num_decode_tokens=3,
        num_sampled=4,
        num_preempted=1,
        num_blocks_swapped_out=2,
        num_blocks_swapped_in=0,
        forward_s=0.02,
        swap_s=0.001,
        step_s=0.03,
        num_swapped_out=1,
    )
    metrics.observe_step(EngineStats(step, Census({0: 2}, {5: 1}, {-3: 1}, 0.0), 1.5, 7, 10, 2, 8))
    metrics.observe_finished(
        FinalEvent("r", FinishReason.LENGTH, Usage(12, 3), Timings(0.1, 0.2, 0.4, (0.2, 0.3, 0.4)))
    )
    metrics.observe_dead_letter("invalid_type")
    metrics.observe_fair_queue({"a": 2}, {"a": 24}, 1)  # polled from Redis with --fair-queue
    gateway = GatewayMetrics()
    gateway.observe_request("/v1/chat/completions", 200, 0.5)
    gateway.time_to_first_token.observe(0.1)
    return {
        sample.name
        for registry in (metrics.registry, gateway.registry)
        for family in registry.collect()
        for sample in family.samples
    }


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\b(?!\s*\()", expr)  # an identifier not called as a function
    return {name for name in names if name not in PROMQL_WORDS}


def generator():
    """ops/grafana/dashboards.py, a script rather than a package module."""
    spec = importlib.util.spec_from_file_location("dashboards", ROOT / "ops" / "grafana" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed() -> dict:
    return json.loads(COMMITTED.read_text())


def fields_grafana_drops(written: object, typed: object, path: str = "") -> list[str]:
    """The paths of `written` that Grafana's typed model did not give back as they were."""
    if isinstance(written, dict) and isinstance(typed, dict):
        return [
            p for key, value in written.items() for p in fields_grafana_drops(value, typed.get(key), f"{path}.{key}")
        ]
    if isinstance(written, list) and isinstance(typed, list) and len(written) == len(typed):
        return [p for i, (w, t) in enumerate(zip(written, typed)) for p in fields_grafana_drops(w, t, f"{path}[{i}]")]
    return [] if written == typed else [path]


def through_grafanas_model(dashboard: dict) -> dict:
    """The dashboard read into the SDK's typed Dashboard (panels and queries by plugin) and written back."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()  # so timeseries options and Prometheus queries are typed, not kept as raw dicts
    return json.loads(JSONEncoder().encode(Dashboard.from_json(dashboard)))


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


@needs_sdk
def test_the_committed_dashboard_is_what_the_generator_writes():
    assert COMMITTED.read_text() == generator().render(), "stale: run `make dashboards` and commit the JSON"


@needs_sdk
def test_grafanas_typed_model_keeps_every_field_of_the_dashboard():
    dashboard = committed()
    assert fields_grafana_drops(dashboard, through_grafanas_model(dashboard)) == []


@needs_sdk
def test_a_field_outside_grafanas_schema_is_caught():
    dashboard = committed()
    dashboard["panels"][1]["options"]["legend"]["displayMod"] = "list"  # a typo
    dashboard["panels"][1]["targets"][0]["expression"] = "up"  # Prometheus queries say expr
    dashboard["panels"][1]["fieldConfig"]["defaults"]["units"] = "s"
    assert fields_grafana_drops(dashboard, through_grafanas_model(dashboard)) == [
        ".panels[1].fieldConfig.defaults.units",
        ".panels[1].options.legend.displayMod",
        ".panels[1].targets[0].expression",
    ]


def test_each_section_is_an_open_row_with_its_panels_beneath_it_two_a_line():
    panels = committed()["panels"]
    assert [(p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels] == sorted(
        (p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels
    ), "panels in reading order"
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps a panel above it"
        assert set(range(pos["y"])) <= {y for _, y in occupied}, f"an empty band above {panel['title']}"
        occupied |= cells
        if panel["type"] == "row":
            assert (pos["x"], pos["w"], panel["collapsed"], panel["panels"]) == (0, 24, False, [])
        else:
            assert (pos["w"], pos["h"]) == (12, 8)


def test_the_metric_name_extraction_finds_what_a_query_reads():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(inflight_a_seconds_bucket{outcome=~"x|y"}[5m])))'
        " / ignoring(kind) group_left sum(inflight_b_total offset 5m) and on(pool) up"
    )
    assert metric_names(expr) == {"inflight_a_seconds_bucket", "inflight_b_total", "up"}


def test_every_panel_queries_only_metrics_the_worker_exports():
    exported = exported_series_names() | PROMETHEUS_OWN
    queries = panel_queries(committed())
    unknown = {(title, name) for title, expr in queries for name in metric_names(expr) if name not in exported}
    assert not unknown, f"panels query metrics the worker does not export: {sorted(unknown)}"
    assert all(metric_names(expr) for _, expr in queries)


def test_a_panel_on_an_unknown_metric_is_caught():
    exported = exported_series_names()
    assert metric_names("sum(rate(inflight_tokens_generated_total[5m]))") - exported == {
        "inflight_tokens_generated_total"
    }
    assert metric_names("rate(inflight_request_duration_seconds_bucket[5m])") <= exported
    assert metric_names("rate(inflight_request_duration_seconds_buckets[5m])") - exported  # a typo'd suffix


def test_the_dashboard_has_the_panels_the_operators_need():
    dashboard = committed()
    queries = " ".join(expr for _, expr in panel_queries(dashboard))
    for metric in (
        "inflight_generation_tokens_total",
        "inflight_time_to_first_token_seconds_bucket",
        "inflight_inter_token_latency_seconds_bucket",
        "inflight_request_duration_seconds_bucket",
        "inflight_scheduler_requests",
        "inflight_ingest_lag_entries",
        "inflight_kv_cache_usage_ratio",
        "inflight_preemptions_total",
        "inflight_swapped_blocks_total",
        "inflight_step_tokens_sum",
        "inflight_step_duration_seconds_bucket",
        "inflight_dead_letters_total",
        "inflight_prefix_cache_queried_tokens_total",
        "inflight_prefix_cache_hit_tokens_total",
        "inflight_prefix_cache_blocks",
        "inflight_prefix_cache_evicted_blocks_total",
        "inflight_prefix_cache_offloaded_blocks_total",
        "inflight_gateway_requests_total",
        "inflight_gateway_time_to_first_token_seconds_bucket",
        "inflight_tenant_tokens_total",
        "inflight_tenant_queued_requests",
        "inflight_refused_requests_total",
        "inflight_batch_queued_requests",
    ):
        assert metric in queries, metric
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    datasource = {p["datasource"]["uid"] for p in dashboard["panels"] if p["type"] != "row"}
    provisioned = (ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text()
    assert datasource == {"inflight-prometheus"} and "uid: inflight-prometheus" in provisioned
