"""REDIS_URL reaches servers that require a login (ACL users) and TLS (rediss://)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.processes import RedisServer
from service.sdk import SyncClient

pytestmark = pytest.mark.slow


def make_certificates(directory: Path) -> None:
    """A CA, and a server certificate it signs for 127.0.0.1."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"
    )
    (directory / "san.cnf").write_text("subjectAltName = IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        "-out",
        "server.pem",
    )


@pytest.fixture
def secured_redis(tmp_path):
    """A private redis-server that speaks only TLS and only to the ACL user `inflight`."""
    make_certificates(tmp_path)
    server = RedisServer(
        tmp_path / "redis",
        appendonly=False,
        username="inflight",
        password="s3cret",
        tls_ca=tmp_path / "ca.pem",
        args=(
            "--tls-cert-file",
            str(tmp_path / "server.pem"),
            "--tls-key-file",
            str(tmp_path / "server.key"),
            "--tls-ca-cert-file",
            str(tmp_path / "ca.pem"),
            "--tls-auth-clients",
            "no",
            "--user",
            "default",
            "off",
            "--user",
            "inflight",
            "on",
            ">s3cret",
            "~inflight:*",
            "&*",
            "+@all",
        ),
    )
    with server:
        yield server.url


def start_worker(redis_url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--consumer",
            "secure-test",
            "--kv-memory-mb",
            "128",
            "--swap-memory-mb",
            "16",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
