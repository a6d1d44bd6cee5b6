"""`inflight bench --scenario tenants`, run tiny: two fair-queue workers, real processes on
the local Redis, a flood against two light tenants, batch jobs under an interactive load,
and an overload against a cap on queued jobs (a file of its own, as the other
multi-process scenarios have)."""

from __future__ import annotations

import pytest

from tests.bench.test_bench_scenarios import bench, finite_positive

pytestmark = pytest.mark.slow

LIGHT, FLOOD, PROBE, INTERACTIVE, BATCH, OVERLOAD, CAP = 3, 3, 8, 4, 12, 24, 1


def accounted(jobs: dict, sent: int) -> bool:
    """Every job sent ended one way or another, and none failed otherwise."""
    ended = jobs["completed"] + jobs["cancelled"] + jobs["refused"]
    return jobs["sent"] == sent and ended == sent and jobs["unfinished"] == jobs["other"] == 0


def test_tenants_scenario_accounts_for_every_job_in_each_part(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "tenants",
        "--model",
        "random:tiny-llama",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--prompt-len",
        "8",
        "16",
        "--output-len",
        "2",
        "4",
        "--tenants-max-running",
        "1",
        "--tenants-light-jobs",
        str(LIGHT),
        "--tenants-flood",
        str(FLOOD),
        "--tenants-prompt-len",
        "16",
        "--tenants-output-len",
        "4",
        "--tenants-capacity-jobs",
        str(PROBE),
        "--tenants-interactive-jobs",
        str(INTERACTIVE),
        "--tenants-batch-jobs",
        str(BATCH),
        "--tenants-overload-jobs",
        str(OVERLOAD),
        "--tenants-overload",
        "50",  # all but at once: more than the workers hold and the cap admits
        "--tenants-max-queued-jobs",
        str(CAP),
    )
    figures = report["tenants"]
    assert figures["parts"] == ["a", "b", "c"]

    # (a): the light tenants were served whole; the flood's rest was cancelled.
    a = figures["a"]
    assert accounted(a["jobs"], (FLOOD + 2 + 2) * LIGHT)  # the flood, the light tenants, then alone
    assert a["tenants"]["light-1"]["outcomes"] == a["tenants"]["light-2"]["outcomes"] == {"length": LIGHT}
    assert set(a["tenants"]["heavy"]["outcomes"]) <= {"length", "cancelled"}
    gap = a["gap"]
    assert gap["vtc_bound_weighted_tokens"] == 2 * (a["longest_prompt_tokens"] + 2 * 4) > 0
    assert all(g >= 0 for _, g in gap["series"]) and gap["samples"] == len(gap["series"])
    assert gap["max_weighted_tokens"] is None or gap["max_weighted_tokens"] == max(g for _, g in gap["series"])
    for key in ("light_ttft_ms", "alone_ttft_ms"):
        assert finite_positive(a[key]["p50"]) and a[key]["p50"] <= a[key]["p99"], key
    if a["share_while_all_backlogged"] is not None:
        assert abs(sum(a["share_while_all_backlogged"].values()) - 1) < 0.01

    capacity = figures["capacity"]
    assert capacity["source"] == "measured" and capacity["jobs"] == PROBE
    assert finite_positive(capacity["requests_per_s"]) and finite_positive(capacity["weighted_tokens_per_s"])

    # (b): the interactive load ran twice, whole; the batch backlog was served or cancelled.
    b = figures["b"]
    assert accounted(b["jobs"]["interactive"], 2 * INTERACTIVE) and b["jobs"]["interactive"]["cancelled"] == 0
    assert accounted(b["jobs"]["batch"], BATCH) and b["jobs"]["batch"]["refused"] == 0
    for run in ("alone", "with_batch"):
        assert finite_positive(b[run]["ttft_p99_ms"]) and b[run]["outcomes"] == {"length": INTERACTIVE}, run
        assert finite_positive(b[run]["interactive_weighted_tokens"]), run
    with_batch = b["with_batch"]
    assert with_batch["batch_weighted_tokens"] >= 0 and with_batch["preemptions"] >= 0
    assert with_batch["idle_capacity_used"] is None or with_batch["idle_capacity_used"] >= 0
    assert finite_positive(b["ttft_p99_over_alone"])

    # (c): each job was accepted and served, or refused at once with a dead letter and a
    # time to retry after; the queue never held more than the cap, and nothing was left.
    c = figures["c"]
    assert c["caps"]["max_queued_jobs"] == CAP and c["caps"]["max_queue_wait_s"] > 0  # (b)'s TTFT p99 alone
    assert accounted(c["jobs"], OVERLOAD) and c["jobs"]["cancelled"] == 0
    refused = c["jobs"]["refused"]
    assert refused > 0 and c["refused_share"] == round(refused / OVERLOAD, 3)
    assert c["dead_letters_queue_full"] == refused
    assert 0 <= c["refusal_ms"]["p50"] <= c["refusal_ms"]["p99"] <= c["refusal_ms"]["max"]
    assert 1 <= c["retry_after_s"]["p50"] <= c["retry_after_s"]["max"] <= 60
    assert c["max_queued_seen"] <= CAP and c["queued_at_end"] == 0
    accepted = c["accepted"]
    assert accepted["jobs"] == OVERLOAD - refused and accepted["unfinished"] == 0
    assert finite_positive(accepted["ttft_p99_ms"]) and finite_positive(c["accepted_ttft_p99_over_b_alone"])

    settings = report["tenants"]["settings"]
    assert settings["jobs_held_per_worker"] == 1 and settings["prefix_caching"] == "off"
