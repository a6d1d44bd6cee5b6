"""REDIS_URL reaches servers that require a login (ACL users) and TLS (rediss://)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.sdk import SyncClient

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_certificates(directory: Path) -> None:
    """A CA, and a server certificate it signs for 127.0.0.1."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
            "-out", "server.csr")
    (directory / "san.cnf").write_text("subjectAltName = IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.cnf", "-out", "server.pem")


@pytest.fixture
def secured_redis(tmp_path):
    """A private redis-server that speaks only TLS and only to the ACL user `inflight`."""
    make_certificates(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem",
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--user", "default", "off", "--user", "inflight", "on", ">s3cret", "~inflight:*", "&*", "+@all"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    yield f"rediss://inflight:s3cret@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
    server.kill()
    server.wait()


def start_worker(redis_url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--consumer", "secure-test", "--kv-memory-mb", "128",
         "--swap-memory-mb", "16", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"},
    )


def test_a_worker_serves_over_tls_as_an_acl_user_given_only_redis_url(secured_redis):
    worker = start_worker(secured_redis)
    try:
        with SyncClient(secured_redis) as client:
            events = list(client.generate("The capital of France is", max_tokens=6))
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert [e["type"] for e in events] == ["token"] * 6 + ["done"], output
    assert "Paris" in "".join(e["text"] for e in events)
    assert worker.returncode == 0
    assert "s3cret" not in output  # the password is not logged
    assert "rediss://inflight:***@127.0.0.1" in output


def test_wrong_credentials_stop_the_worker_with_a_clear_error(secured_redis):
    worker = start_worker(secured_redis.replace("s3cret", "not-the-password"))
    try:
        output, _ = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 2
    assert "redis_credentials_refused" in output
    assert "not-the-password" not in output
