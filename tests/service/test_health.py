"""`inflight health`, the workers' container healthcheck: healthy only while the worker's
metrics answer, Redis answers and its consumer has just talked to its group; each
failure named. Against a real Redis, a real metrics server, and (the slow test) a real
worker process run as docker-compose.yml runs its healthcheck."""

from __future__ import annotations

import contextlib
import http.server
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
import yaml

from bench.processes import REPO_ROOT, WorkerProcess, free_port
from service.embedded import embedded_valkey
from service.health import HealthConfig, check, report
from service.ingest import RENEW
from service.metrics import Metrics, start_metrics_server
from tests.waiting import wait_until

REDIS_URL = "redis://127.0.0.1:6379"


@pytest.fixture
def client():
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def stream(client):
    """A private request stream on the shared Redis, deleted afterwards."""
    name = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    yield name
    client.delete(name)


@pytest.fixture
def metrics_port():
    """A real worker metrics endpoint (the worker's own server and registry), on a free port."""
    port = free_port()
    server = start_metrics_server(port, Metrics().registry, "127.0.0.1")
    yield port
    server.shutdown()


def config(**fields) -> HealthConfig:
    return HealthConfig(**{"redis_url": REDIS_URL, "consumer": "health-test", **fields})


def read_as(client, stream: str, consumer: str) -> None:
    """A worker's first reads: its own pending entries (which puts it in the group), then new ones."""
    try:
        client.xgroup_create(stream, "inflight", id="0", mkstream=True)
    except redis.ResponseError as error:  # another consumer made it
        assert "BUSYGROUP" in str(error)
    client.xreadgroup("inflight", consumer, {stream: "0"}, count=1)
    client.xreadgroup("inflight", consumer, {stream: ">"}, count=1)


def test_healthy_when_the_metrics_answer_redis_answers_and_the_consumer_just_read(client, stream, metrics_port):
    read_as(client, stream, "health-test")
    serving = config(metrics_port=metrics_port, requests_stream=stream)
    health = check(serving)
    assert health.healthy, health.problems
    assert report(serving, health).startswith(f"healthy: health-test serves {stream}")
    assert report(serving, health).endswith(f", metrics on port {metrics_port}")


def test_a_worker_not_serving_yet_is_unhealthy_until_its_consumer_reads(client, stream, metrics_port):
    # No group yet: no worker ever served this stream.
    health = check(config(metrics_port=metrics_port, requests_stream=stream))
    assert health.problems == (f"no consumer group inflight on {stream} yet: no worker has started serving it",)
    # Another worker serves it, this one not yet (it loads its model with its metrics already up).
    read_as(client, stream, "another-worker")
    [problem] = check(config(metrics_port=metrics_port, requests_stream=stream)).problems
    assert problem.startswith(f"consumer health-test is not in group inflight of {stream}")
    read_as(client, stream, "health-test")
    assert check(config(metrics_port=metrics_port, requests_stream=stream)).healthy


@pytest.fixture
def valkey(tmp_path):
    """A private Valkey server (the embedded one): XINFO CONSUMERS as Redis 7.2 and later
    report it, where every read or lease renewal resets a consumer's idle time."""
    with embedded_valkey(free_port(), tmp_path / "valkey") as url:
        client = redis.Redis.from_url(url)
        yield url, client
        client.close()


def test_a_consumer_silent_for_longer_than_max_idle_is_unhealthy(valkey, metrics_port):
    url, client = valkey
    read_as(client, "inflight:requests", "health-test")
    quick = config(metrics_port=metrics_port, redis_url=url, max_idle_s=0.2)
    assert check(quick).healthy
    wait_until(lambda: not check(quick).healthy, 10, "the consumer's idle time to pass 0.2 s")
    [problem] = check(quick).problems
    assert problem.startswith("consumer health-test last talked to inflight:requests ")
    assert problem.endswith(" s ago (over 0.2 s): it has stopped serving")


def test_an_idle_worker_reading_an_empty_stream_and_a_full_one_renewing_leases_stay_healthy(valkey, metrics_port):
    url, client = valkey
    read_as(client, "inflight:requests", "idle-worker")
    client.xadd("inflight:requests", {"id": "job"})
    read_as(client, "inflight:requests", "full-worker")  # it holds the job now
    renew = client.register_script(RENEW)  # the worker's own lease renewal
    # Both silent for longer than max_idle_s, then each does its part. The margin leaves
    # time for the two checks on a loaded 2-core machine (0.25 s of it was once too little).
    max_idle_s = 1.0
    time.sleep(max_idle_s + 0.2)
    client.xreadgroup("inflight", "idle-worker", {"inflight:requests": ">"}, count=1, block=10)
    assert renew(keys=["inflight:requests"], args=["inflight", "full-worker", *held(client, "full-worker")]) == []
    for consumer in ("idle-worker", "full-worker"):
        health = check(config(metrics_port=metrics_port, redis_url=url, consumer=consumer, max_idle_s=max_idle_s))
        assert health.healthy, health.problems
        assert health.idle_s < max_idle_s


def held(client, consumer: str) -> list[str]:
    return [
        row["message_id"].decode()
        for row in client.xpending_range("inflight:requests", "inflight", "-", "+", 10, consumername=consumer)
    ]


def test_before_redis_7_2_a_consumer_is_judged_by_its_presence_alone(client, stream, metrics_port):
    if tuple(map(int, client.info("server")["redis_version"].split(".")[:2])) >= (7, 2):
        pytest.skip("this Redis resets a consumer's idle time on every read: the test above covers it")
    read_as(client, stream, "health-test")
    time.sleep(0.3)  # an idle worker's empty reads leave its idle time growing here
    client.xreadgroup("inflight", "health-test", {stream: ">"}, count=1)
    health = check(config(metrics_port=metrics_port, requests_stream=stream, max_idle_s=0.2))
    assert health.healthy and health.idle_s is None


def test_unhealthy_when_redis_is_unreachable(metrics_port):
    nobody = free_port()  # nothing listens there
    health = check(config(metrics_port=metrics_port, redis_url=f"redis://127.0.0.1:{nobody}"))
    [problem] = health.problems
    assert problem.startswith("cannot reach Redis:") and f"127.0.0.1:{nobody}" in problem
    assert report(config(), health) == f"unhealthy: {problem}"


def test_unhealthy_when_nothing_or_something_else_answers_on_the_metrics_port(client, stream):
    read_as(client, stream, "health-test")
    port = free_port()
    [problem] = check(config(metrics_port=port, requests_stream=stream)).problems
    assert problem.startswith(f"metrics at http://127.0.0.1:{port}/metrics do not answer")

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"some_other_metric 1\n")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        [problem] = check(config(metrics_port=port, requests_stream=stream)).problems
        assert (
            problem
            == f"http://127.0.0.1:{port}/metrics answers without inflight's metrics: another server holds the port"
        )
    finally:
        server.shutdown()
        server.server_close()


def compose_healthcheck(*overrides: str) -> list[str]:
    """The worker's healthcheck command from docker-compose.yml, run here (flags given
    after it win: a private Redis and a free metrics port)."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    test = compose["services"]["worker-cpu"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "inflight", "health"]
    return [sys.executable, "-m", "service.cli", *test[2:], *overrides]


@pytest.mark.slow
def test_the_compose_healthcheck_passes_on_a_serving_worker_and_names_redis_or_the_worker_when_they_go(tmp_path):
    port = free_port()
    with contextlib.ExitStack() as redis_server:  # Valkey: a Redis of 7.2 and later, as compose's
        url = redis_server.enter_context(embedded_valkey(port, tmp_path / "valkey"))
        # As in a container: the default streams, and the host name as the consumer name.
        worker = WorkerProcess(
            socket.gethostname(),
            [
                "--redis-url",
                url,
                "--kv-memory-mb",
                "64",
                "--swap-memory-mb",
                "16",
                "--threads",
                "1",
                "--log-format",
                "json",
            ],
            tmp_path,
        )
        healthcheck = compose_healthcheck("--metrics-port", str(worker.metrics_port), "--redis-url", url)

        def run() -> subprocess.CompletedProcess:
            return subprocess.run(healthcheck, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)

        before = run()
        assert before.returncode == 1 and "no worker has started serving" in before.stderr
        worker.start()
        try:
            worker.wait_ready()
            wait_until(lambda: run().returncode == 0, 30, "the healthcheck to pass")
            assert run().stdout.startswith(
                f"healthy: {socket.gethostname()} serves inflight:requests (last talked to it "
            )
            # Idle, with no job in sight, it still reads its group every half second.
            time.sleep(1.5)
            idle = subprocess.run(
                [*healthcheck, "--max-idle-s", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
            )
            assert idle.returncode == 0, idle.stderr

            redis_server.close()  # Redis goes away; the worker rides it out
            redis_gone = run()
            assert redis_gone.returncode == 1
            assert (
                redis_gone.stderr.startswith("unhealthy: cannot reach Redis:")
                and f"127.0.0.1:{port}" in redis_gone.stderr
            )
            assert "metrics" not in redis_gone.stderr  # the worker itself still answers

            worker.kill()
            worker_gone = run()
            assert worker_gone.returncode == 1
            assert f"metrics at http://127.0.0.1:{worker.metrics_port}/metrics do not answer" in worker_gone.stderr
        finally:
            if worker.alive():
                worker.kill()
