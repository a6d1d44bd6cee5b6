"""`inflight bench --scenario structured`, run tiny on the real model: the report keys
the issue names, with figures that hang together."""

from __future__ import annotations

import pytest

from tests.bench.test_bench_scenarios import bench, finite_positive

pytestmark = pytest.mark.slow


def test_structured_scenario_reports_cost_compile_times_and_validity(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "structured",
        "--requests",
        "2",
        "--prompt-len",
        "8",
        "16",
        "--output-len",
        "2",
        "4",
        "--structured-rounds",
        "1",
        "--structured-schemas",
        "4",
        "--structured-validity",
        "--structured-max-tokens",
        "8",
    )
    figures = report["structured"]
    throughput = figures["throughput"]
    # Both runs made every asked-for token: the bench schema never ends within them.
    runs = throughput["runs"]
    assert runs["unconstrained"][0]["output_tokens"] == runs["json_schema"][0]["output_tokens"]
    assert runs["json_schema"][0]["finish_reasons"] == ["length"]
    assert finite_positive(throughput["constrained_vs_unconstrained"])
    assert figures["compile"]["schemas"] == 4
    assert 0 < figures["compile"]["p50_ms"] <= figures["compile"]["p99_ms"] <= figures["compile"]["max_ms"]
    for mode in ("greedy", "temperature_1"):
        validity = figures["validity"][mode]
        assert validity["valid"] == validity["stopped"], validity["failures"]
        assert sum(validity["finish_reasons"].values()) == validity["requests"]
