"""The benchmark harness: workload generator, metrics math, report, and one tiny real run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest

from bench.arrivals import ArrivalQueue, at_t0, bursts
from bench.http_client import token_times
from bench.main import add_arguments, run
from bench.metrics import RequestRecord, inter_token_latencies, latency_figures, percentile, summarize
from bench.report import SYSTEM_KEYS, build_report, format_table, write_png
from bench.throughput import DEFAULT_VLLM_PYTHON, single_stream_workload, without_missing_peers
from bench.workload import Workload, allowed_token_ids, make_workload, special_token_ids

SPECIAL = {0, 1, 2, 7}
ALLOWED = allowed_token_ids(50, SPECIAL)


def test_workload_is_seeded_in_range_and_avoids_special_tokens():
    a = make_workload(40, (3, 9), (2, 6), ALLOWED, seed=5)
    assert a == make_workload(40, (3, 9), (2, 6), ALLOWED, seed=5)
    assert a != make_workload(40, (3, 9), (2, 6), ALLOWED, seed=6)
    assert len(a.requests) == 40 and len({r.request_id for r in a.requests}) == 40
    for r in a.requests:
        assert 3 <= len(r.prompt_ids) <= 9
        assert 2 <= r.output_len <= 6
        assert all(0 <= t < 50 and t not in SPECIAL for t in r.prompt_ids)
    # Over 40 requests both ends of each range show up (uniform, inclusive).
    assert {3, 9} <= {len(r.prompt_ids) for r in a.requests}
    assert {2, 6} <= {r.output_len for r in a.requests}
    assert a.total_output_tokens == sum(r.output_len for r in a.requests)


def test_workload_rejects_bad_ranges():
    with pytest.raises(ValueError):
        make_workload(3, (5, 4), (1, 2), ALLOWED)
    with pytest.raises(ValueError):
        make_workload(3, (1, 4), (0, 2), ALLOWED)


def test_workload_round_trips_through_json(tmp_path):
    workload = make_workload(5, (2, 4), (1, 3), ALLOWED, seed=1)
    workload.save(tmp_path / "w.json")
    assert Workload.load(tmp_path / "w.json") == workload


def test_a_system_that_made_other_lengths_than_asked_fails_the_run():
    workload = make_workload(2, (3, 5), (2, 4), ALLOWED, seed=1)
    exact = {r.request_id: [0.1] * r.output_len for r in workload.requests}
    workload.check_lengths("peer", exact)
    short = exact | {"req-1": exact["req-1"][1:]}
    with pytest.raises(RuntimeError, match="peer: req-1 produced"):
        workload.check_lengths("peer", short)


def test_special_token_ids_include_added_special_tokens():
    class Added:
        def __init__(self, special):
            self.special = special

    class Tokenizer:
        all_special_ids = [0, 2]
        added_tokens_decoder = {0: Added(True), 2: Added(True), 5: Added(True), 9: Added(False)}

    assert special_token_ids(Tokenizer()) == {0, 2, 5}


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97 between 3 and 4
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summarize_on_hand_made_timestamps():
    token_times = {"a": [1.0, 1.5, 2.5], "b": [2.0, 2.2]}
    assert inter_token_latencies(token_times["a"]) == [0.5, 1.0]
    s = summarize(token_times, peak_rss_mb=123.0)
    assert s["wall_s"] == 2.5
    assert s["output_tokens_per_s"] == pytest.approx(5 / 2.5)
    assert s["requests_per_s"] == pytest.approx(2 / 2.5)
    assert s["ttft_p50_s"] == pytest.approx(1.5)
    assert s["ttft_p99_s"] == pytest.approx(1.99)
    # Gaps pooled over requests: 0.2, 0.5, 1.0.
    assert s["itl_p50_s"] == pytest.approx(0.5)
    assert s["itl_p99_s"] == pytest.approx(0.5 + 0.98 * 0.5)
    assert s["peak_rss_mb"] == 123.0


def test_bursts_send_size_requests_at_once_every_period_from_the_first():
    assert bursts(5, 2, every_s=1.5) == [0.0, 0.0, 1.5, 1.5, 3.0]
    assert bursts(3, 1, every_s=2.0, first_s=2.0) == [2.0, 4.0, 6.0]
    assert at_t0(3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        bursts(3, 0, every_s=1.0)


def test_an_open_loop_queue_releases_each_request_at_its_send_time():
    queue = ArrivalQueue(["a", "b", "c"], times=[0.0, 1.0, 1.0])
    assert queue.due(now_s=0.5) == ["a"] and queue.next_s() == 1.0
    assert queue.due(now_s=0.9) == []
    assert queue.due(now_s=1.0) == ["b", "c"] and not queue and queue.next_s() is None


def test_a_closed_loop_queue_keeps_concurrency_requests_in_flight():
    queue = ArrivalQueue(["a", "b", "c", "d"], concurrency=2)
    assert queue.due(in_flight=0) == ["a", "b"]
    assert queue.due(in_flight=2) == []
    assert queue.due(in_flight=1) == ["c"] and len(queue) == 1
    with pytest.raises(ValueError):
        ArrivalQueue(["a"])


def test_latency_figures_of_request_records_leave_failures_out():
    records = [
        RequestRecord(sent_s=0.0, chunk_times_s=[0.1, 0.2, 0.4], end_s=0.4, completion_tokens=4),
        RequestRecord(sent_s=1.0, chunk_times_s=[0.3], end_s=0.3, completion_tokens=1),
        RequestRecord(sent_s=0.0, error="boom"),
    ]
    figures = latency_figures(records)
    assert figures["ttft_p50_ms"] == pytest.approx(200) and figures["e2e_p99_ms"] == pytest.approx(399)
    assert figures["tpot_mean_ms"] == pytest.approx(100)  # (0.4 - 0.1) / 3; a one-token answer has none
    assert figures["itl_p50_ms"] == pytest.approx(150)
    assert latency_figures([]) == dict.fromkeys(figures)
    # Token times after t0: a held-back token counts at the last chunk.
    assert token_times(records[0]) == [0.1, 0.2, 0.4, 0.4]
    assert token_times(records[1]) == [1.3]


def test_report_ratios_table_and_png(tmp_path):
    engine = summarize({"a": [1.0, 2.0]}, 10.0) | {"overhead_fraction": 0.1, "ceiling_fraction": 0.9}
    static = summarize({"a": [2.0, 4.0]}, 20.0)
    workload = {"requests": 1, "prompt_len": [1, 2], "output_len": [2, 2], "model": "m"}
    report = build_report(workload, {}, {"engine": engine, "hf_static": static})
    assert report["engine_vs_hf_static"] == pytest.approx(2.0)
    assert report["engine_vs_hf_continuous"] is None
    table = format_table(report)
    assert "engine" in table and "hf_static" in table and "overhead_fraction" in table
    # One request: the time between tokens, per system, is the figure a user feels.
    assert "time between tokens (p50, one request): engine 1000.0 ms, hf_static 2000.0 ms" in table
    write_png(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiny_real_run_writes_json_and_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--requests",
            "3",
            "--prompt-len",
            "4",
            "12",
            "--output-len",
            "2",
            "5",
            "--systems",
            "engine,hf_continuous,hf_static",
            "--hf-batch-tokens",
            "64",
            "--json",
            str(tmp_path / "bench.json"),
        ]
    )
    report = run(args)

    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk["workload"]["requests"] == 3
    assert set(on_disk["systems"]) == {"engine", "hf_continuous", "hf_static"}
    for name, figures in on_disk["systems"].items():
        for key in SYSTEM_KEYS:
            assert figures[key] > 0, (name, key)
        assert figures["output_tokens"] == on_disk["workload"]["total_output_tokens"]
    engine = on_disk["systems"]["engine"]
    assert 0 <= engine["overhead_fraction"] < 1
    assert engine["ceiling_fraction"] > 0
    assert on_disk["systems"]["hf_continuous"]["max_batch_tokens"] == 64
    assert set(on_disk["systems"]["hf_continuous"]["sweep"]) == {"64"}
    assert on_disk["engine_vs_hf_continuous"] > 0 and on_disk["engine_vs_hf_static"] > 0
    assert report == on_disk
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "engine vs hf_static" in capsys.readouterr().out


def test_a_system_run_in_rounds_reports_its_median_round_and_every_rounds_rate():
    from bench.throughput import median_round

    runs = [{"output_tokens_per_s": rate, "wall_s": 10 / rate} for rate in (500.0, 700.0, 600.0)]
    median = median_round(runs)
    assert median["wall_s"] == pytest.approx(10 / 600)  # a whole round's figures, not a blend
    assert median["rounds_output_tokens_per_s"] == [500.0, 700.0, 600.0]
    assert median_round(runs[:2])["output_tokens_per_s"] == 500.0  # the lower middle of an even count
    assert median_round(runs[:1]) == runs[0]


def test_help_reads_as_sections_general_workload_systems_then_each_scenario():
    parser = argparse.ArgumentParser(prog="inflight bench")
    add_arguments(parser)
    help_text = parser.format_help()
    assert help_text.startswith("usage: inflight bench [--scenario NAME]")
    sections = ["general:", "workload (", "systems and peers:", "spec scenario", "serve scenario"]
    positions = [help_text.index(section) for section in sections]
    assert positions == sorted(positions)
    workload = help_text[help_text.index("workload (") : help_text.index("systems and peers:")]
    assert "--prompt-len" in workload and "--vllm-python" not in workload
    serve = help_text[help_text.index("serve scenario") :]
    assert "--serve-rates" in serve and "--requests " not in serve
    # The sections change nothing a command line means.
    args = parser.parse_args([])
    assert (args.scenario, args.requests, args.prompt_len, args.output_len) == ("throughput", 48, [20, 400], [16, 192])
    assert (args.systems, args.static_batch, args.serve_rates) == (
        "engine,hf_continuous,hf_static,llamacpp,vllm",
        8,
        "2,4",
    )


def test_single_stream_is_one_request_of_100_prompt_and_256_output_tokens():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--scenario", "single"])
    single_stream_workload(args)
    assert (args.requests, args.prompt_len, args.output_len) == (1, [100, 100], [256, 256])
    args = parser.parse_args(["--scenario", "single", "--output-len", "32", "32"])
    single_stream_workload(args)
    assert (args.requests, args.prompt_len, args.output_len) == (1, [100, 100], [32, 32])


def test_llamacpp_is_skipped_with_a_line_when_not_installed(monkeypatch, capsys):
    import bench.peer_llamacpp

    monkeypatch.setattr(bench.peer_llamacpp, "available", lambda: False)
    assert without_missing_peers(["engine", "llamacpp"]) == ["engine"]
    assert "llamacpp skipped: llama-cpp-python is not installed" in capsys.readouterr().err
    monkeypatch.setattr(bench.peer_llamacpp, "available", lambda: True)
    assert without_missing_peers(["engine", "llamacpp"]) == ["engine", "llamacpp"]


def test_vllm_is_skipped_with_a_line_where_its_environment_is_missing(tmp_path, capsys):
    missing = tmp_path / "no-venv" / "bin" / "python"
    assert without_missing_peers(["engine", "vllm"], missing) == ["engine"]
    assert f"vllm skipped: {missing} is missing (`make vllm-peer` builds it)" in capsys.readouterr().err


def test_vllm_settings_are_every_core_for_its_engine_or_its_own_default():
    from bench.peer_vllm import settings

    both = settings(2)["both-cores"]
    assert (both["OMP_NUM_THREADS"], both["VLLM_CPU_OMP_THREADS_BIND"], both["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == (
        "2",
        "0-1",
        "0",
    )
    assert not {"OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"} & set(
        settings(2)["default"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # vLLM's first start compiles its model (minutes on 2 cores)
@pytest.mark.skipif(not DEFAULT_VLLM_PYTHON.exists(), reason="vLLM's environment is missing (make vllm-peer)")
def test_tiny_real_run_with_vllm(tmp_path):
    """vLLM's CPU backend makes exactly the asked tokens of the same token ids."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--requests", "3", "--prompt-len", "4", "12", "--output-len", "2", "5",
                              "--systems", "vllm", "--vllm-settings", "both-cores",
                              "--json", str(tmp_path / "bench.json")])  # fmt: skip
    report = run(args)
    figures = report["systems"]["vllm"]
    assert figures["output_tokens"] == report["workload"]["total_output_tokens"]
    assert figures["setting"] == "both-cores" and figures["output_tokens_per_s"] > 0
    assert figures["environment"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and figures["vllm"] == "0.32.0"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_tiny_real_run_with_llamacpp(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--requests", "3", "--prompt-len", "4", "12", "--output-len", "2", "5",
                              "--systems", "llamacpp", "--json", str(tmp_path / "bench.json")])  # fmt: skip
    report = run(args)
    figures = report["systems"]["llamacpp"]
    assert figures["output_tokens"] == report["workload"]["total_output_tokens"]
    assert figures["llama_cpp_python"] == "0.3.36" and figures["output_tokens_per_s"] > 0
