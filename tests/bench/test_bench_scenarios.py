"""The scheduler scenarios of `inflight bench`, each run tiny on the real model: they
produce the report keys the issue names, with figures that hang together."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench.main import add_arguments, run


def finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def bench(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*argv, "--json", str(tmp_path / "report.json")])
    report = run(args)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    return report


def test_scheduler_decision_cost_is_reported(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "scheduler",
        "--scheduler-running",
        "32",
        "--scheduler-waiting",
        "100",
        "--scheduler-decisions",
        "20",
    )
    figures = report["scheduler"]
    assert figures["running"] == 32 and figures["waiting"] == 100 and figures["decisions"] == 20
    assert 0 < figures["decision_p50_ms"] <= figures["decision_p99_ms"]


@pytest.mark.slow
def test_storm_compares_budgets_on_and_off_at_the_same_positions(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "storm",
        "--storm-running",
        "2",
        "--storm-burst",
        "2",
        "--storm-prompt-len",
        "40",
        "60",
        "--storm-output-len",
        "2",
        "--storm-prefill-tokens",
        "8",
        "--storm-steady-steps",
        "8",
    )
    storm = report["storm"]
    on, off = storm["budgets_on"], storm["budgets_off"]
    for key in ("itl_p99_burst_s", "itl_p50_steady_s"):
        assert on[key] > 0
    assert off["itl_p99_burst_s"] > 0
    assert on["max_prefill_tokens"] == 8 and off["max_prefill_tokens"] == off["max_batch_tokens"]
    # With 8 prompt tokens per step the burst takes more steps than with the whole budget.
    assert on["burst_steps"] > off["burst_steps"]
    # Both runs met the same seeded burst, and the steady pace was measured (a third run).
    assert on["burst_prompt_tokens"] == off["burst_prompt_tokens"] and 2 * 40 <= on["burst_prompt_tokens"] <= 2 * 60
    assert (
        finite_positive(storm["steady"]["itl_p50_s"]) and storm["steady"]["itl_p50_s"] <= storm["steady"]["itl_p99_s"]
    )
    assert finite_positive(storm["burst_p99_over_steady_p50"]) and finite_positive(storm["off_p99_over_on_p99"])


@pytest.mark.slow
def test_priority_scenario_high_priority_jumps_the_backlog(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "priority",
        "--priority-low",
        "24",
        "--priority-high",
        "3",
        "--priority-high-every",
        "0.2",
    )
    figures = report["priority"]
    assert figures["low_requests"] == 24 and figures["high_requests"] == 3
    assert figures["high_ttft_p50_s"] < figures["low_ttft_p50_s"]
    assert figures["low_overtaken_by_max_s"] <= figures["priority_bound_s"]


@pytest.mark.slow
def test_swap_scenario_preempts_only_with_the_small_pool(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "swap",
        "--swap-requests",
        "4",
        # Each request needs 3 or 4 blocks of 16 tokens, the four at least 12: 6 hold one
        # whole, not all four.
        "--swap-pool-blocks",
        "6",
        "--swap-prompt-len",
        "16",
        "32",
        "--swap-output-len",
        "20",
        "24",
    )
    swap = report["swap"]
    assert swap["large_pool"]["preemptions"] == 0
    assert swap["small_pool_swap"]["blocks_swapped_out"] > 0
    assert swap["small_pool_swap"]["blocks_swapped_in"] == swap["small_pool_swap"]["blocks_swapped_out"]
    assert swap["small_pool_recompute"]["preemptions"] > 0
    assert swap["small_pool_recompute"]["blocks_swapped_out"] == 0
    # Every pool produced the whole workload, preempted or not; the small ones in more steps.
    pools = [swap[name] for name in ("large_pool", "small_pool_swap", "small_pool_recompute")]
    assert len({pool["output_tokens"] for pool in pools}) == 1 and 4 * 20 <= pools[0]["output_tokens"] <= 4 * 24
    assert all(pool["steps"] > swap["large_pool"]["steps"] for pool in pools[1:])
    assert finite_positive(swap["swap_vs_large_pool"]) and finite_positive(swap["recompute_vs_large_pool"])


def test_redis_scenario_runs_the_workload_through_a_worker_process_and_in_process(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "redis",
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
        "--redis-rounds",
        "2",
        "--ttft-pairs",
        "2",
    )
    figures = report["redis"]
    rounds = figures["rounds"]
    assert len(rounds["redis"]) == len(rounds["inprocess"]) == 2
    # Both paths did the whole workload in every round: every requested token arrived.
    expected = figures["workload"]["total_output_tokens"]
    assert [r["output_tokens"] for r in rounds["redis"] + rounds["inprocess"]] == [expected] * 4
    # Each path's throughput pools its rounds, so it lies within the rounds' own figures.
    for path, pooled in (("redis", "output_tokens_per_s"), ("inprocess", "inprocess_output_tokens_per_s")):
        per_round = [r["output_tokens_per_s"] for r in rounds[path]]
        assert finite_positive(figures[pooled])
        assert min(per_round) * (1 - 1e-9) <= figures[pooled] <= max(per_round) * (1 + 1e-9)
    assert finite_positive(figures["throughput_ratio"])  # the two paths, measured apart
    assert figures["ttft_pairs"] == 2 and finite_positive(figures["ttft_p50_s"])
    assert finite_positive(figures["inprocess_ttft_p50_s"]) and math.isfinite(figures["ttft_overhead_p50_s"])


@pytest.mark.slow
def test_soak_scenario_short_loses_nothing_through_a_redis_restart_and_a_worker_kill(tmp_path):
    # 15 s of traffic: Redis restarts 5 s in, w1 is killed 9 s in and restarts within it.
    report = bench(
        tmp_path,
        "--scenario",
        "soak",
        "--soak-minutes",
        "0.25",
        "--soak-warmup-s",
        "4",
        "--soak-concurrency",
        "24",
        "--soak-max-tokens",
        "24",
        "--soak-reply-ttl-s",
        "10",
        "--soak-drain-s",
        "60",
        "--seed",
        "3",
    )
    soak = report["soak"]
    assert soak["jobs"]["sent"] > 20 and soak["jobs"]["lost"] == 0
    assert soak["seqs"] == {"duplicate": 0, "missing": 0, "events_after_final": 0, "usage_mismatch": 0}
    assert soak["kv_blocks_in_use_at_end"] == {"w1": 0, "w2": 0}
    assert all(state["requests_in_engine"] == 0 for state in soak["idle_at_end"].values())
    assert soak["workers_alive_at_end"] == {"w1": True, "w2": True}
    # The chaos happened: Redis came back, and the killed worker was streaming.
    assert soak["redis_restart"]["down_s"] is not None and soak["kill"]["streams"] > 0
    assert soak["kill"]["not_resumed"] == 0
    assert soak["malformed"]["without_dead_letter"] == 0


def test_intake_scenario_reports_what_one_redis_shard_takes_in(tmp_path):
    report = bench(tmp_path, "--scenario", "intake", "--intake-jobs", "1000", "--intake-renewals", "2")
    intake = report["intake"]
    assert intake["jobs"] == 1000 and intake["renewals_per_job"] == 2
    assert finite_positive(intake["jobs_per_s"]) and finite_positive(intake["redis_cpu_us_per_job"])
    assert finite_positive(intake["shard_jobs_per_s_at_one_core"])


def test_edge_scenario_delivers_every_event_through_the_real_worker_per_step_and_per_event(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "edge",
        "--edge-streams",
        "8,32",
        "--edge-tokens",
        "20",
        "--edge-step-ms",
        "0",
        "--edge-baseline",
    )
    rows = report["edge"]["rows"]
    assert [(row["publishing"], row["streams"]) for row in rows] == [
        ("per_step", 8),
        ("per_step", 32),
        ("per_event", 8),
        ("per_event", 32),
    ]
    for row in rows:
        assert row["events"] == row["streams"] * 20
        assert finite_positive(row["events_per_s"]) and finite_positive(row["redis_bytes_per_token"])
        assert finite_positive(row["offered_events_per_s"])
        assert row["sustained_events_per_s"] is None or finite_positive(row["sustained_events_per_s"])
        assert 0 < row["publish_lag_p50_ms"] <= row["publish_lag_p99_ms"]
    # Per step, one round trip carries many streams; per event, each its own.
    assert all(row["streams_per_round_trip"] > 1 for row in rows if row["publishing"] == "per_step")
    assert all(row["streams_per_round_trip"] == 1 for row in rows if row["publishing"] == "per_event")


@pytest.mark.slow
def test_prefix_scenario_reuses_cached_prefixes_by_tier(tmp_path):
    # The shared prefix is longer than a step's prompt budget (512), so the first request's
    # prefix takes the first step alone and the others find it cached.
    report = bench(
        tmp_path,
        "--scenario",
        "prefix",
        "--prefix-requests",
        "3",
        "--prefix-shared-len",
        "520",
        "--prefix-suffix-len",
        "2",
        "6",
        "--prefix-output-len",
        "2",
        "3",
        "--prefix-conversations",
        "3",
        "--prefix-turns",
        "2",
        "--prefix-first-len",
        "24",
        "--prefix-message-len",
        "4",
        "--prefix-turn-output-len",
        "2",
        "--prefix-n-prompts",
        "2",
        "--prefix-n-prompt-len",
        "40",
        "--prefix-n",
        "3",
        "--prefix-n-output-len",
        "3",
    )
    figures = report["prefix"]
    shared = figures["shared"]["systems"]
    # Every system produced the same outputs; only the caching ones found the shared prefix.
    assert (
        len({s["output_tokens"] for s in shared.values()}) == 1
        and 3 * 2 <= shared["host_tier"]["output_tokens"] <= 3 * 3
    )
    assert shared["caching_off"]["cache"]["queried_tokens"] == 0
    for name in ("device_only", "host_tier"):
        assert shared[name]["cache"]["device_hit_tokens"] >= 2 * 512 and shared[name]["cache"]["host_hit_tokens"] == 0
    assert shared["hf_continuous"]["allow_block_sharing"] is True and shared["hf_continuous"]["prefix_hit_tokens"] >= 0
    for key in ("tok_s_vs_caching_off", "ttft_p50_caching_off_over_on", "tok_s_vs_hf_continuous"):
        assert finite_positive(figures["shared"][key])

    # A pool too small for every history: only the host tier gets evicted turns back.
    turns = figures["multi_turn"]
    assert turns["same_histories"] and turns["pool_share_of_final_histories"] < 1
    device, host = turns["systems"]["device_only"]["cache"], turns["systems"]["host_tier"]["cache"]
    assert device["host_hit_tokens"] == 0 and device["offloaded_blocks"] == 0
    assert host["offloaded_blocks"] > 0 and host["host_hit_tokens"] > 0
    assert 0 < host["host_hit_rate"] <= 1 and finite_positive(turns["ttft_p50_device_only_over_host_tier"])

    # n choices hold one copy of their prompt's KV.
    assert figures["n"]["peak_blocks_parallel"] < figures["n"]["peak_blocks_independent"]
    assert figures["n"]["blocks_per_sequence_parallel"] < figures["n"]["blocks_per_sequence_independent"]
    assert figures["n"]["systems"]["parallel"]["output_tokens"] == 2 * 3 * 3
    assert (tmp_path / "report.png").stat().st_size > 0


def test_overhead_scenario_reports_the_host_time_of_each_phase(tmp_path):
    """A stub forward behind the real engine: each size's steps ran that many decodes,
    and the phases add up to the host time of the steps that timed them."""
    report = bench(
        tmp_path,
        "--scenario",
        "overhead",
        "--overhead-sizes",
        "4,16",
        "--overhead-steps",
        "12",
        "--overhead-prompt-len",
        "20",
        "40",
        "--overhead-output-len",
        "4",
        "12",
    )
    sizes = report["overhead"]["sizes"]
    assert set(sizes) == {"4", "16"}
    for size, figures in sizes.items():
        per_step = figures["per_step_ms"]
        assert figures["steps"] == 12 and figures["decoding_requests"] == int(size)
        assert int(size) - 2 <= figures["tokens_per_step"] <= int(size) + 2  # a full batch, some finishing
        for phase in ("scheduling", "metadata", "sampling", "detokenization", "events"):
            assert finite_positive(per_step[phase]["mean"]), phase
        phases = sum(
            per_step[phase]["mean"]
            for phase in ("scheduling", "metadata", "sampling", "detokenization", "events", "other")
        )
        assert phases == pytest.approx(per_step["timed_total"]["mean"])
        assert finite_positive(per_step["total"]["p50"])  # from the steps run without the timing wrappers


@pytest.mark.slow
def test_spec_scenario_compares_speculation_on_and_off_on_the_same_tokens(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "spec",
        "--spec-copy-requests",
        "1",
        "--spec-max-tokens",
        "12",
        "--spec-concurrency",
        "1",
        "--requests",
        "2",
        "--prompt-len",
        "8",
        "12",
        "--output-len",
        "4",
        "6",
    )
    figures = report["spec"]
    assert set(figures) == {"max_draft_tokens", "copy_c1", "default"}
    for name in ("copy_c1", "default"):
        run = figures[name]
        assert run["identical"] and finite_positive(run["speedup"])
        assert run["off"]["output_tokens"] == run["on"]["output_tokens"] > 0
        assert run["off"]["drafted_tokens"] == 0
    copy = figures["copy_c1"]
    assert copy["copied_fraction"] > 0.5  # the model quotes its prompt
    on = copy["on"]
    assert 0 < on["accepted_tokens"] <= on["drafted_tokens"] and on["steps"] < copy["off"]["steps"]
    assert sum(on["verified_tokens_per_request_step"].values()) > 0 and on["mean_verified_tokens"] > 1
