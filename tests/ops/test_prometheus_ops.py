"""ops/prometheus: the configuration and alert rules pass promtool, and the alerts fire
(and stay quiet) as their unit tests say. CI installs promtool (Debian's `prometheus`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "ops" / "prometheus"

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=OPS, capture_output=True, text=True, timeout=60)


def test_the_prometheus_config_and_its_rules_pass_promtool():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "alerts.yml" in result.stdout  # the rule file is found and checked with it


def test_the_alert_rules_cover_backlog_starvation_dead_letters_and_a_worker_down():
    import yaml

    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    rules = [rule for group in yaml.safe_load((OPS / "alerts.yml").read_text())["groups"] for rule in group["rules"]]
    expressions = {rule["alert"]: rule["expr"] for rule in rules}
    assert "inflight_ingest_lag_entries" in expressions["InflightBacklogGrowing"]
    assert "inflight_oldest_waiting_age_seconds" in expressions["InflightRequestStarving"]
    assert "inflight_dead_letters_total" in expressions["InflightDeadLetters"]
    assert "up{" in expressions["InflightWorkerDown"]


def test_the_alerts_fire_as_their_unit_tests_say():
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
