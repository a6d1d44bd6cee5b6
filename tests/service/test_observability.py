"""Observability with real parts: a real `inflight worker` with fair queueing serves real
requests of several tenants through Redis (priorities, a batch job, preemption and swapping
on a tiny KV pool, a job the engine rejects, a job that cannot be decoded, a job refused at
admission), a real Prometheus scrapes it every second with the alert
rules loaded, and every dashboard panel's query must return data through Prometheus'
HTTP API (a gateway in front of the same stream serves one streamed completion, for the
gateway's panels; then a prefill and a decode worker on streams of their own hand one job
over, its prompt's K/V read with NIXL, for the disaggregation panels). The live scrapes
pass `promtool check metrics`; the worker's log is JSON lines, one summary per request,
without prompts.

CI installs Prometheus (Debian's `prometheus`); without the binaries this skips.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "List the numbers from 1 to 300, comma separated:"
WINDOW = "2m"  # what `$__rate_interval` becomes: wider than the whole run, at a 1 s scrape interval

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("promtool")),
        reason="prometheus and promtool are not installed (CI installs them)",
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = condition()
        except OSError:  # not listening yet
            result = None
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


class PrometheusAPI:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> dict:
        """The `data` of an instant query now; fails on an error status."""
        body = json.loads(get(f"{self.base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
        assert body["status"] == "success", (expr, body)
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)["result"]
        return float(result[0]["value"][1]) if result else None


def disagg_worker(role: str, prefix: str, metrics_port: int, log) -> subprocess.Popen:
    """A `--role prefill` or `--role decode` worker on the pair's own streams, small memory."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--requests-stream",
            f"{prefix}:pd:requests",
            "--dead-letter-stream",
            f"{prefix}:pd:dead",
            "--control-stream",
            f"{prefix}:pd:control",
            "--consumer",
            role,
            "--metrics-port",
            str(metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--ingest-poll-s",
            "0.5",
            "--kv-memory-mb",
            "64",
            "--swap-memory-mb",
            "64",
            "--role",
            role,
            "--handoff-stream",
            f"{prefix}:pd:handoffs",
            "--handoff-min-prompt-tokens",
            "8",
            "--handoff-memory-mb",
            "16",
            "--log-format",
            "json",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture
def prefix():
    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis(host="127.0.0.1", port=6379)
    client.delete(*(client.keys(f"{prefix}*") or [prefix]), *(client.keys(f"inflight:out:{{{prefix}*") or [prefix]))
    client.close()


def test_prometheus_scrapes_a_serving_worker_and_every_panel_has_data(tmp_path, prefix):
    metrics_port, prometheus_port = free_port(), free_port()
    pair_ports = {"prefill": free_port(), "decode": free_port()}
    pair: list[subprocess.Popen] = []
    stream, dead = f"{prefix}:requests", f"{prefix}:dead"
    gateway_port = free_port()
    worker_log = (tmp_path / "worker.log").open("w")
    pair_log = (tmp_path / "pair.log").open("w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--requests-stream",
            stream,
            "--dead-letter-stream",
            dead,
            "--control-stream",
            f"{prefix}:control",
            "--consumer",
            "observed",
            "--metrics-port",
            str(metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--ingest-poll-s",
            "0.5",
            # The tenants row: a job whose prompt alone is over this cap is refused (queue_full).
            "--fair-queue",
            "--max-queued-tokens",
            "400",
            # 5 device blocks and 2 host blocks: four requests of 4 blocks each preempt and swap.
            "--kv-memory-mb",
            "4",
            "--swap-memory-mb",
            "2",
            "--log-format",
            "json",
        ],
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # The gateway's panels need a gateway: one in front of the same stream.
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "gateway",
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--requests-stream",
            stream,
            "--control-stream",
            f"{prefix}:control",
            "--port",
            str(gateway_port),
            "--log-format",
            "json",
            "--reply-timeout-s",
            "300",
        ],
        stdout=(tmp_path / "gateway.log").open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "ops" / "prometheus" / "alerts.yml")],
        "scrape_configs": [
            {"job_name": "inflight", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
            {"job_name": "inflight-gateway", "static_configs": [{"targets": [f"127.0.0.1:{gateway_port}"]}]},
            {
                "job_name": "inflight-disagg",
                "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in pair_ports.values()]}],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    api = PrometheusAPI(prometheus_port)
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        wait_until(lambda: get(f"{api.base}/-/ready"), 60, "Prometheus to be ready")
        wait_until(lambda: get(f"http://127.0.0.1:{metrics_port}/metrics"), 180, "the worker's /metrics")
        # A counter's increase before its first scrape is invisible to rate(): start from a scrape.
        wait_until(lambda: api.scalar('sum(up{job="inflight"})') == 1, 30, "a first scrape of the worker")
        wait_until(lambda: api.scalar('sum(up{job="inflight-gateway"})') == 1, 30, "a first scrape of the gateway")

        # First, on an idle worker (so the run stays within the queries' window): one
        # streamed completion through the gateway.
        streamed = urllib.request.Request(
            f"http://127.0.0.1:{gateway_port}/v1/completions",
            method="POST",
            headers={"content-type": "application/json"},
            data=json.dumps(
                {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 4, "stream": True}
            ).encode(),
        )
        with urllib.request.urlopen(streamed, timeout=300) as response:
            assert response.read().endswith(b"data: [DONE]\n\n")
        through_gateway = response.headers["x-request-id"]

        served = {
            f"{prefix}-{name}": priority for name, priority in (("low", -5), ("mid", 0), ("mid2", 0), ("high", 5))
        }
        tenants = {"low": {"tenant": "a"}, "high": {"tenant": "a"}, "mid2": {"tenant": "b", "batch": "true"}}
        for request_id, priority in served.items():
            client.xadd(
                stream,
                {
                    "id": request_id,
                    "prompt": PROMPT,
                    "max_tokens": "40",
                    "priority": str(priority),
                    **tenants.get(request_id.removeprefix(f"{prefix}-"), {}),
                },
            )
        client.xadd(stream, {"id": f"{prefix}-huge", "prompt": PROMPT, "max_tokens": "100000", "priority": "2"})
        client.xadd(stream, {"id": f"{prefix}-garbled", "prompt": PROMPT, "max_tokens": "lots"})
        # About 520 prompt tokens, over --max-queued-tokens by itself: refused at admission.
        client.xadd(stream, {"id": f"{prefix}-refused", "prompt": PROMPT * 40, "max_tokens": "4", "tenant": "b"})
        replies = [
            f"inflight:out:{{{request_id}}}"
            for request_id in [*served, f"{prefix}-huge", f"{prefix}-garbled", f"{prefix}-refused"]
        ]
        replies.append(f"inflight:out:{{{through_gateway}}}")

        def finished(reply: str) -> bool:
            return any(fields[b"type"] in (b"done", b"error") for _, fields in client.xrevrange(reply, count=1))

        wait_until(lambda: all(finished(r) for r in replies), 300, "every request to finish", interval_s=0.5)
        # Prometheus has scraped the worker after the last request ended, and the lag poll has run.
        wait_until(
            lambda: api.scalar('sum(inflight_requests_total{job="inflight"})') == 8,
            30,
            "a scrape after the last request",
        )
        wait_until(lambda: api.scalar("sum(inflight_gateway_requests_total)") == 1, 30, "a scrape of the gateway")
        wait_until(lambda: api.scalar("max(inflight_dead_letter_stream_entries)") == 3, 30, "the ingest poll")
        wait_until(
            lambda: api.scalar("max(inflight_ingest_pending_entries) + max(inflight_ingest_lag_entries)") == 0,
            30,
            "every entry delivered and acked",
        )

        # The disaggregation panels: a prefill and a decode worker (started only now: their
        # transfer agents' progress threads keep a core busy) hand one job over.
        pair.extend(disagg_worker(role, prefix, port, pair_log) for role, port in pair_ports.items())
        for port in pair_ports.values():
            wait_until(lambda: get(f"http://127.0.0.1:{port}/metrics"), 180, "the pair's /metrics")
        wait_until(lambda: api.scalar('sum(up{job="inflight-disagg"})') == 2, 30, "a first scrape of the pair")
        handed = f"inflight:out:{{{prefix}-handed}}"
        # Three blocks of prompt: the full ones travel as K/V.
        client.xadd(f"{prefix}:pd:requests", {"id": f"{prefix}-handed", "prompt": PROMPT * 3, "max_tokens": "8"})
        wait_until(lambda: finished(handed), 300, "the handed-off job to finish", interval_s=0.5)
        # Each worker is scraped on its own schedule: wait for a scrape of both after the handoff.
        wait_until(
            lambda: (
                api.scalar('sum(inflight_handoff_requests_total{outcome="kv_read"})') == 1
                and api.scalar('sum(inflight_handoff_requests_total{outcome="handed_off"})') == 1
                and api.scalar("sum(inflight_kv_transfer_bytes_total)") > 0
            ),
            30,
            "a scrape of both workers after the handoff",
        )
        assert client.xrevrange(handed, count=1)[0][1][b"worker"] == b"decode"

        dashboard = json.loads((ROOT / "ops" / "grafana" / "dashboards" / "inflight.json").read_text())
        empty = []
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", WINDOW)
                values = [float(series["value"][1]) for series in api.query(expr)["result"]]
                if not any(math.isfinite(v) for v in values):
                    empty.append((panel["title"], expr, values))
        assert not empty, f"panels without data: {empty}"

        # What the panels show is what happened (on the observed worker: the pair served one job more).
        assert (
            api.scalar('sum(inflight_requests_total{job="inflight", outcome="length"})')
            + api.scalar('sum(inflight_requests_total{job="inflight", outcome="stop"})')
            == 5
        )
        assert api.scalar('sum(inflight_requests_total{job="inflight", outcome="error"})') == 1
        assert api.scalar('sum(inflight_requests_total{job="inflight", outcome="rejected"})') == 2
        assert api.scalar('sum(inflight_preemptions_total{job="inflight"})') > 0
        assert api.scalar('sum(inflight_kv_cache_blocks{job="inflight", pool="device"})') == 5
        by_priority = api.query(
            f'max by (priority) (max_over_time(inflight_scheduler_requests{{state="running"}}[{WINDOW}]))'
        )
        assert {int(series["metric"]["priority"]) for series in by_priority["result"]} == {-5, 0, 5}
        assert api.scalar(f'max(max_over_time(inflight_kv_cache_usage_ratio{{pool="device"}}[{WINDOW}]))') > 0.5
        assert api.scalar('sum(inflight_dead_letters_total{job="inflight"})') == 3
        # The tenants row: what each tenant was served adds up to the worker's totals, by kind.
        assert api.scalar('sum(inflight_refused_requests_total{job="inflight", tenant="b", code="queue_full"})') == 1
        assert api.scalar('sum(inflight_tenant_tokens_total{job="inflight", class="batch", kind="output"})') > 0
        for kind, total in (("output", "inflight_generation_tokens_total"), ("prompt", "inflight_prompt_tokens_total")):
            assert api.scalar(f'sum(inflight_tenant_tokens_total{{job="inflight", kind="{kind}"}})') == api.scalar(
                f'sum({total}{{job="inflight"}})'
            )
        assert api.scalar('max(inflight_tenant_queued_requests{job="inflight", tenant="a"})') == 0
        # Prefix caching is on by default: every admission queried the cache.
        assert api.scalar("sum(inflight_prefix_cache_queried_tokens_total)") > 0

        # Every alert rule evaluates without error against live data.
        rules = json.loads(get(f"{api.base}/api/v1/rules"))["data"]["groups"]
        evaluated = [
            (rule["name"], rule["health"], rule.get("lastError")) for group in rules for rule in group["rules"]
        ]
        assert len(evaluated) == 6 and all(health == "ok" for _, health, _ in evaluated), evaluated
        for rule in yaml.safe_load((ROOT / "ops" / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]:
            api.query(rule["expr"])

        for port in (metrics_port, pair_ports["decode"]):
            exposition = get(f"http://127.0.0.1:{port}/metrics")
            lint = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60)
            assert lint.returncode == 0 and not lint.stdout and not lint.stderr, lint.stdout + lint.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        for process in pair:
            process.terminate()
        gateway.terminate()
        prometheus.terminate()
        try:
            worker.wait(timeout=60)
        finally:
            worker.kill()
            prometheus.wait(timeout=30)
            gateway.wait(timeout=30)
            for process in pair:
                try:
                    process.wait(timeout=60)
                finally:
                    process.kill()
            client.close()
            worker_log.close()
            pair_log.close()

    log = (tmp_path / "worker.log").read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    summaries = {line["request_id"]: line for line in lines if line["event"] == "request_finished"}
    assert {request_id: line["priority"] for request_id, line in summaries.items()} == {
        **served,
        f"{prefix}-huge": 2,
        through_gateway: 0,
    }
    assert summaries[f"{prefix}-huge"]["finish_reason"] == "error"
    assert all(summaries[r]["completion_tokens"] > 0 and summaries[r]["first_token_s"] > 0 for r in served)
    dead_lettered = sorted(line["code"] for line in lines if line["event"] == "job_dead_lettered")
    assert dead_lettered == ["invalid_request", "invalid_type", "queue_full"]
    assert [line["event"] for line in lines][-1] == "worker_stopped"
    assert PROMPT not in log  # prompts stay out of the log unless the operator opts in
