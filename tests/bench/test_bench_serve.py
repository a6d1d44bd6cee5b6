"""`inflight bench --scenario serve`: its arrivals and arithmetic on fixed inputs, and one
tiny real run against inflight (redis-server, worker and gateway processes)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.arrivals import BURST, poisson, rate_points
from bench.main import add_arguments, run
from bench.metrics import RequestRecord
from bench.serve import HEADLINE, _pooled, ratios, summarize_point


def test_poisson_arrivals_are_seeded_start_at_t0_and_have_the_asked_mean_rate():
    arrivals = poisson(20_000, 4.0, seed=7)
    assert arrivals == poisson(20_000, 4.0, seed=7)
    assert arrivals != poisson(20_000, 4.0, seed=8)
    assert arrivals[0] == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(4.0, rel=0.03)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Exponential gaps: the standard deviation is the mean.
    mean = sum(gaps) / len(gaps)
    spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert spread == pytest.approx(mean, rel=0.05)


def test_each_rate_gets_its_own_arrivals_and_the_burst_sends_all_at_t0():
    points = rate_points(5, [2.0, 4.0], burst=True, seed=0)
    assert list(points) == ["rate_2", "rate_4", BURST]
    assert points["rate_2"] != points["rate_4"]
    assert points[BURST] == [0.0] * 5
    assert BURST not in rate_points(5, [2.0], burst=False, seed=0)


def record(ttft: float, gaps: list[float], tokens: int, **fields) -> RequestRecord:
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        sent_s=0.0, chunk_times_s=times, end_s=times[-1], completion_tokens=tokens, prompt_tokens=10, **fields
    )


def test_point_figures_on_fixed_records():
    records = [
        record(0.1, [0.02, 0.02, 0.02], 4),  # TPOT 20 ms
        record(0.5, [0.05, 0.05], 3),  # TPOT 50 ms
        record(0.2, [0.3], 5),  # one chunk of four tokens: TPOT (0.5 - 0.2) / 4 = 75 ms, one 300 ms gap
        RequestRecord(sent_s=0.0, error="HTTP 500: boom"),
    ]
    figures = summarize_point(records, duration_s=2.0, slo_ttft_ms=300, slo_tpot_ms=60)
    assert (figures["requests"], figures["completed"], figures["failures"]) == (4, 3, 1)
    assert figures["errors"] == ["HTTP 500: boom"]
    assert figures["output_tokens"] == 12 and figures["prompt_tokens"] == 30
    assert figures["output_tokens_per_s"] == pytest.approx(6.0)
    assert figures["requests_per_s"] == pytest.approx(1.5)
    assert figures["ttft_p50_ms"] == pytest.approx(200)
    assert figures["ttft_p99_ms"] == pytest.approx(200 + 300 * 0.98)  # linear between 200 and 500
    assert figures["tpot_mean_ms"] == pytest.approx((20 + 50 + 75) / 3)
    assert figures["tpot_p50_ms"] == pytest.approx(50)
    assert figures["itl_p50_ms"] == pytest.approx(35)  # gaps 20, 20, 20, 50, 50, 300
    assert figures["e2e_p50_ms"] == pytest.approx(500)  # ends 160, 600, 500
    # Only the first meets both SLOs (the second's TTFT and the third's TPOT miss); the failure counts as not good.
    assert figures["goodput_requests"] == 1
    assert figures["goodput_share"] == pytest.approx(0.25)
    assert figures["goodput_requests_per_s"] == pytest.approx(0.5)


def test_a_one_token_answer_has_no_tpot_and_meets_the_tpot_slo():
    figures = summarize_point([record(0.1, [], 1)], duration_s=1.0, slo_ttft_ms=200, slo_tpot_ms=1)
    assert figures["tpot_mean_ms"] is None and figures["itl_p50_ms"] is None
    assert figures["goodput_share"] == 1.0


def test_rounds_pool_their_requests_per_point_and_keep_each_rounds_own_figures():
    args = argparse.Namespace(slo_ttft_ms=300, slo_tpot_ms=100)
    first = {"rate_2": ([record(0.1, [0.02], 2)], 1.0)}
    second = {"rate_2": ([record(0.5, [0.02], 2), record(0.3, [0.02], 2)], 3.0)}
    pooled = _pooled([first, second], args)
    point = pooled["points"]["rate_2"]
    assert (point["requests"], point["output_tokens"]) == (3, 6)
    assert point["output_tokens_per_s"] == pytest.approx(6 / 4.0)  # the rounds' durations add up
    assert point["ttft_p50_ms"] == pytest.approx(300)  # over all three requests
    assert [r["rate_2"]["requests"] for r in pooled["rounds"]] == [1, 2]
    assert "rounds" not in _pooled([first], args)


def test_ratios_divide_inflight_by_vllm_and_leave_missing_figures_out():
    inflight = dict.fromkeys(HEADLINE, 3.0) | {"tpot_mean_ms": None}
    vllm = dict.fromkeys(HEADLINE, 2.0) | {"goodput_share": 0.0}
    result = ratios(inflight, vllm)
    assert result["output_tokens_per_s"] == pytest.approx(1.5)
    assert result["tpot_mean_ms"] is None and result["goodput_share"] is None


@pytest.mark.slow
def test_serve_scenario_against_inflight_returns_figures_for_every_request(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--scenario",
            "serve",
            "--systems",
            "engine",
            "--requests",
            "3",
            "--prompt-len",
            "8",
            "16",
            "--output-len",
            "3",
            "6",
            "--serve-rates",
            "8",
            "--json",
            str(tmp_path / "report.json"),
        ]
    )
    serve = run(args)["serve"]
    assert list(serve["systems"]) == ["inflight"] and "ratio_inflight_to_vllm" not in serve
    points = serve["systems"]["inflight"]["points"]
    assert list(points) == ["rate_8", BURST]
    for figures in points.values():
        assert (figures["requests"], figures["completed"], figures["failures"]) == (3, 3, 0), figures["errors"]
        assert figures["output_tokens"] == serve["workload"]["total_output_tokens"]
        assert figures["prompt_tokens"] > 0  # random ids decoded to text need not re-encode to as many
        for name in ("ttft_p50_ms", "tpot_mean_ms", "itl_p50_ms", "e2e_p99_ms", "output_tokens_per_s"):
            assert figures[name] > 0, name
        assert figures["e2e_p99_ms"] >= figures["ttft_p99_ms"]
    # The chart is written beside the report, in the bench's one style.
    assert serve["png"] == str(tmp_path / "report.png") and (tmp_path / "report.png").stat().st_size > 0
