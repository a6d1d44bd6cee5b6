"""`inflight bench --scenario disagg`, run tiny: a prefill and a decode worker, one worker on
both cores and two on one core each, real processes on the local Redis, under a small
prefill storm (a file of its own, as the other multi-process scenarios have)."""

from __future__ import annotations

import math

import pytest

from tests.bench.test_bench_scenarios import bench, finite_positive

pytestmark = pytest.mark.slow
pytest.importorskip("nixl_cu12")  # the K/V move with NIXL (the `disagg` extra)

RUNNING, STORM, LONE = 2, 2, 1


def test_disagg_scenario_reports_each_configuration_under_a_prefill_storm(tmp_path):
    report = bench(
        tmp_path,
        "--scenario",
        "disagg",
        "--model",
        "random:tiny-llama",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--disagg-running",
        str(RUNNING),
        "--disagg-running-prompt-len",
        "24",
        "--disagg-storm",
        str(STORM),
        "--disagg-prompt-len",
        "48",
        "--disagg-output-len",
        "4",
        "--disagg-steady-tokens",
        "4",
        "--disagg-lone",
        str(LONE),
        "--disagg-min-prompt-tokens",
        "16",
    )
    figures = report["disagg"]
    configs = figures["configurations"]
    assert list(configs) == ["disagg", "colocated_one", "colocated_two"]
    for name, config in configs.items():
        storm = config["storm"]
        assert finite_positive(storm["ttft_p50_s"]) and storm["ttft_p50_s"] <= storm["ttft_p99_s"], name
        # a loaded machine reads several tokens in one XREAD: gaps of zero are what the client saw
        assert storm["steady_gaps"] > 0 and 0 <= storm["itl_p50_steady_s"] < math.inf, name
        assert finite_positive(config["lone"]["ttft_p50_s"]) and config["dead_letters"] == 0, name
        assert config["finish_reasons"] == {"length": 4 + LONE + STORM, "cancelled": RUNNING}, name
    assert [w["cores"] for w in configs["colocated_two"]["workers"]] == ["0", "1"]
    assert configs["colocated_one"]["workers"][0] | {"name": None, "idle_cpu_s_per_s": None} == {
        "name": None,
        "role": "both",
        "cores": "0,1",
        "threads": 2,
        "idle_cpu_s_per_s": None,
    }
    assert all(w["idle_cpu_s_per_s"] >= 0 for c in configs.values() for w in c["workers"])
    assert all(sum(c["handoffs"].values()) == 0 for name, c in configs.items() if name != "disagg")

    # On P/D every job (the four warm-ups too) was handed off, and its K/V read with NIXL.
    disagg = configs["disagg"]
    handed_off = 4 + LONE + RUNNING + STORM
    assert disagg["handoffs"]["handed_off"] == handed_off
    assert disagg["handoffs"]["kv_read"] == handed_off and disagg["handoffs"]["kv_failed"] == 0
    assert disagg["finished_by"] == {"decode": handed_off}
    kv = disagg["kv_transfer"]
    assert kv["reads"] == handed_off and finite_positive(kv["bytes_per_s"])
    assert finite_positive(kv["ms_per_1000_prompt_tokens"]) and finite_positive(kv["bytes_per_token"])
    assert 0 <= disagg["lone"]["handoff_to_second_token_p50_s"] < math.inf  # one XREAD can bring both
    assert set(figures["handoff_overhead"]) == {
        f"{key}_vs_{other}_s" for key in ("ttft", "second_token_gap") for other in ("colocated_two", "colocated_one")
    }
    assert all(math.isfinite(v) for v in figures["handoff_overhead"].values())

    # Greedy tokens are the same through P/D as colocated (float32 here).
    for pair, identity in figures["identity"].items():
        assert identity["requests"] == RUNNING + STORM + LONE, pair
        assert identity["identical"] == identity["requests"], (pair, identity["first_difference"])
    assert figures["workload"]["long_prompts"] == "random token ids"
