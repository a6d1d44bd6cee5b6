"""Redis with Sentinel (`redis+sentinel://`, service/connect.py): a real primary, a replica
and three Sentinels on loopback, a real `inflight worker` connected through them, and the
primary SIGKILLed while the worker streams. Sentinel promotes the replica; the worker and
the producer find it through the Sentinels and go on: every job completes, and every
reply stream reads in order with no `seq` twice.

Replication is asynchronous: events the old primary took in the moment before it died
may never reach the replica. The test makes sure some are lost (the replica is paused
while the worker writes, then the primary is killed) and that the worker writes them
again (service/outbox.py, "Repair"): every stream ends gapless.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.processes import RedisServer, WorkerProcess, free_port
from service.connect import connect_sync
from service.sdk import SyncClient
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

SERVICE = "mymaster"


class Sentinels:
    """Three Sentinels watching one primary, quick to call it down."""

    def __init__(self, data_dir: Path, primary_port: int) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.processes = []
        for port in self.ports:
            config = data_dir / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {data_dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
            )
            log = open(data_dir / f"sentinel-{port}.log", "w")
            self.processes.append(
                subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)
            )

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{port}" for port in self.ports) + f"/{SERVICE}"

    def primary_port(self) -> int | None:
        client = connect_sync(f"redis://127.0.0.1:{self.ports[0]}", socket_timeout=2)
        try:
            host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            return int(port)
        except Exception:
            return None

    def ready(self) -> bool:
        """Every Sentinel knows the replica and the two other Sentinels. Until then a
        failover may never come: each learns of the others through hellos published on
        the primary and its replicas, and one that knows neither the replica nor another
        Sentinel once the primary dies has nowhere to hear of them."""
        for port in self.ports:
            client = connect_sync(f"redis://127.0.0.1:{port}", socket_timeout=2)
            try:
                replicas = client.execute_command("SENTINEL", "REPLICAS", SERVICE)
                others = client.execute_command("SENTINEL", "SENTINELS", SERVICE)
            except Exception:
                return False
            if not replicas or len(others) < len(self.ports) - 1:
                return False
        return True

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def replicated(tmp_path):
    # The primary syncs a new replica at once (its default waits 5 s for more replicas).
    primary = RedisServer(tmp_path / "primary", appendonly=False, args=("--repl-diskless-sync-delay", "0"))
    primary.start()
    replica = RedisServer(tmp_path / "replica", appendonly=False, args=("--replicaof", "127.0.0.1", str(primary.port)))
    replica.start()
    sentinels = Sentinels(tmp_path, primary.port)
    try:
        # Until its first sync is done the replica holds nothing: promoted then, it would lose everything.
        replica_client = connect_sync(f"redis://127.0.0.1:{replica.port}")
        wait_until(lambda: replica_client.info("replication")["master_link_status"] == "up", 30, "the replica's sync")
        wait_until(sentinels.ready, 30, "the Sentinels to find the replica and each other")
        yield primary, replica, sentinels
    finally:
        sentinels.stop()
        replica.kill()
        primary.kill()


def test_a_client_through_sentinel_follows_the_primary_across_a_failover(replicated):
    primary, replica, sentinels = replicated
    client = connect_sync(sentinels.url, socket_timeout=2)
    client.set("before", "1")
    primary.kill()

    def writes_again() -> bool:
        try:
            return bool(client.set("after", "1"))
        except Exception:  # down, then read-only or refused until the promotion
            return False

    wait_until(writes_again, 30, "writes through Sentinel after the failover")
    assert sentinels.primary_port() == replica.port
    assert client.get("after") == b"1"


def test_a_worker_through_sentinel_finishes_every_job_across_a_failover_with_no_event_lost(replicated, tmp_path):
    primary, replica, sentinels = replicated
    worker = WorkerProcess(
        "w1", ["--model", "random:tiny-llama", "--redis-url", sentinels.url, "--no-speculative"], tmp_path
    )
    worker.start()
    try:
        worker.wait_ready()
        producer = SyncClient(sentinels.url)
        ids = [producer.submit(f"job {i}: count the stars", max_tokens=400, ignore_eos=True) for i in range(4)]
        reader = connect_sync(sentinels.url, socket_timeout=5)
        wait_until(
            lambda: all(reader.xlen(f"inflight:out:{{{request_id}}}") > 20 for request_id in ids),
            60,
            "every job streaming",
        )
        # What the primary takes now never reaches the replica: lost in the failover. (The
        # replica paused, and its link cut, or it would read what is already on its socket.)
        replica.process.send_signal(signal.SIGSTOP)
        connect_sync(f"redis://127.0.0.1:{primary.port}").execute_command("CLIENT", "KILL", "TYPE", "replica")
        lengths = [reader.xlen(f"inflight:out:{{{request_id}}}") for request_id in ids]
        wait_until(
            lambda: sum(reader.xlen(f"inflight:out:{{{request_id}}}") for request_id in ids) > sum(lengths) + 20,
            30,
            "events the replica does not get",
        )
        primary.kill()
        replica.process.send_signal(signal.SIGCONT)
        killed_at = time.monotonic()

        def finished() -> bool:
            try:
                return all(
                    reader.xrevrange(f"inflight:out:{{{request_id}}}", count=1)[0][1][b"type"] != b"token"
                    for request_id in ids
                )
            except Exception:  # the primary is down, or not yet promoted
                return False

        wait_until(finished, 120, "every job's final event on the new primary")
        print(f"every job ended {time.monotonic() - killed_at:.1f} s after the primary was killed")
        assert sentinels.primary_port() == replica.port
        for request_id in ids:
            events = reader.xrange(f"inflight:out:{{{request_id}}}")
            seqs = [int(fields[b"seq"]) for _, fields in events if fields[b"type"] == b"token"]
            assert events[-1][1][b"type"] == b"done", (request_id, events[-1][1])
            assert seqs == list(range(int(events[-1][1][b"completion_tokens"]))), request_id  # each seq once
        repaired = worker.log_path.read_text().count("reply_stream_repaired")
        print(f"streams repaired after the failover: {repaired}")
        assert repaired > 0  # events were lost, and written again
    finally:
        worker.stop()


@pytest.mark.parametrize(
    "url, sentinels, options",
    [
        ("redis+sentinel://a:26380,b/mymaster", [("a", 26380), ("b", 26379)], {}),
        ("redis+sentinel://u:p%40ss@a:1/mymaster/2", [("a", 1)], {"username": "u", "password": "p@ss", "db": 2}),
        ("rediss+sentinel://a:1/mymaster?ssl_ca_certs=/ca.pem", [("a", 1)], {"ssl": True, "ssl_ca_certs": "/ca.pem"}),
    ],
)
def test_a_sentinel_url_names_the_sentinels_the_primary_and_its_options(url, sentinels, options):
    from service.connect import _sentinel_parts, is_sentinel

    assert is_sentinel(url)
    assert _sentinel_parts(url, {}) == (sentinels, SERVICE, options)


def test_a_sentinel_url_without_the_primarys_name_is_refused():
    from service.connect import _sentinel_parts

    with pytest.raises(ValueError, match="names its primary"):
        _sentinel_parts("redis+sentinel://a:26379", {})
