"""`inflight bench --scenario gateway`, run tiny: the workload through a real gateway and
worker, against the same jobs straight to Redis (a file of its own, so it runs beside the
other scenarios)."""

from __future__ import annotations

import math

import pytest

from tests.bench.test_bench_scenarios import bench, finite_positive


@pytest.mark.slow
def test_gateway_scenario_streams_the_workload_through_the_gateway_and_straight_to_redis(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "gateway",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--requests",
        "3",
        "--prompt-len",
        "8",
        "16",
        "--output-len",
        "3",
        "6",
        "--gateway-rounds",
        "2",
        "--gateway-ttft-pairs",
        "2",
    )
    figures = report["gateway"]
    rounds = figures["rounds"]
    expected = figures["workload"]["total_output_tokens"]
    assert [r["output_tokens"] for r in rounds["gateway"] + rounds["redis"]] == [expected] * 4
    assert figures["streamed_tokens"] == 2 * expected
    for path, pooled in (("gateway", "output_tokens_per_s"), ("redis", "redis_output_tokens_per_s")):
        per_round = [r["output_tokens_per_s"] for r in rounds[path]]
        assert min(per_round) * (1 - 1e-9) <= figures[pooled] <= max(per_round) * (1 + 1e-9)
    assert finite_positive(figures["throughput_ratio"]) and finite_positive(figures["gateway_cpu_s"])
    assert finite_positive(figures["gateway_cpu_ms_per_1000_tokens"])
    assert figures["ttft_pairs"] == 2 and finite_positive(figures["ttft_p50_s"])
    assert finite_positive(figures["redis_ttft_p50_s"]) and math.isfinite(figures["ttft_overhead_p50_s"])
