"""The command line: the demo, `make run`'s worker (on Redis or an embedded Valkey), submit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def test_demo_streams_an_answer_to_a_chat_prompt():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "demo",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "[chat] What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "tokens, first token" in result.stdout


def test_worker_process_serves_a_job_and_exits_cleanly_on_sigterm():
    import signal
    import time
    import uuid

    import redis

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    stream, dead, reply = f"{prefix}:requests", f"{prefix}:dead", f"inflight:out:{{{prefix}-job}}"
    client = redis.Redis(host="127.0.0.1", port=6379)
    client.xadd(stream, {"id": f"{prefix}-job", "prompt": "The capital of France is", "max_tokens": "6"})
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
            "cli-test",
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
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not any(f[b"type"] == b"done" for _, f in client.xrange(reply)):
            time.sleep(0.2)
        replies = client.xrange(reply)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
        client.delete(stream, dead, reply, f"{reply}:owner", f"{prefix}:control")
        client.close()
    types = [f[b"type"] for _, f in replies]
    assert types == [b"token"] * 6 + [b"done"], worker.stdout.read()
    assert "Paris" in "".join(f[b"text"].decode() for _, f in replies)


def test_with_no_redis_url_the_worker_runs_an_embedded_valkey_and_submit_streams_through_it(tmp_path):
    import os
    import signal
    import socket

    import redis

    with socket.socket() as probe:  # a free port, so a developer's own `make run` is not disturbed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "worker",
            "--embedded-port",
            str(port),
            "--embedded-data-dir",
            str(tmp_path / "valkey"),
            "--consumer",
            "embedded-test",
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
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    try:
        banner = ""
        while "Stop with Ctrl-C" not in banner:
            line = worker.stdout.readline()
            assert line, f"the worker exited: {banner}"
            banner += line
        assert f"redis://127.0.0.1:{port} (embedded Valkey)" in banner
        assert f"submit --redis-url redis://127.0.0.1:{port}" in banner  # it says how to submit

        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "service.cli",
                "submit",
                "What is the capital of France?",
                "--max-tokens",
                "12",
                "--priority",
                "3",
                "--redis-url",
                f"redis://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            env=env,
        )
        assert "Paris" in result.stdout
        assert "tokens, first token" in result.stderr
        with_logprobs = subprocess.run(
            [
                sys.executable,
                "-m",
                "service.cli",
                "submit",
                "What is the capital of France?",
                "--max-tokens",
                "4",
                "--logprobs",
                "2",
                "--redis-url",
                f"redis://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            env=env,
        )
        table = [line for line in with_logprobs.stderr.splitlines() if "|" in line]
        assert len(table) == 4 and all(line.count("'") >= 6 for line in table)  # token, then 2 alternatives

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0

        def server_gone() -> bool:
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1).ping()
            except redis.ConnectionError:
                return True
            return False

        wait_until(server_gone, 5, "the embedded server to go with its worker")
        assert (tmp_path / "valkey").is_dir()
    finally:
        worker.kill()
        worker.wait()


def test_two_worker_processes_on_one_stream_split_the_load_with_no_duplicates():
    import time
    import uuid

    import msgpack
    import redis

    prefix = f"inflight:test:{uuid.uuid4().hex[:8]}"
    stream, dead = f"{prefix}:requests", f"{prefix}:dead"
    client = redis.Redis(host="127.0.0.1", port=6379)
    workers = [
        subprocess.Popen(
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
                name,
                "--kv-memory-mb",
                "128",
                "--swap-memory-mb",
                "16",
                "--max-running-requests",
                "2",
                "--threads",
                "1",
                "--metrics-port",
                "0",
            ],  # capacity 4 each: neither can take all
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("left", "right")
    ]
    jobs = [f"{prefix}-{i}" for i in range(16)]
    try:
        for job in jobs:
            client.xadd(stream, {"id": job, "prompt": f"Count from {job[-1]}:", "max_tokens": "24"})
        deadline = time.time() + 300
        replies: dict[str, list[dict]] = {}
        while time.time() < deadline and len(replies) < len(jobs):
            for job in jobs:
                events = [msgpack.unpackb(f[b"data"]) for _, f in client.xrange(f"inflight:out:{{{job}}}")]
                if events and events[-1]["type"] == "done":
                    replies[job] = events
            time.sleep(0.5)
        pending = client.xpending(stream, "inflight")["pending"]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        client.delete(
            stream,
            dead,
            f"{prefix}:control",
            *[f"inflight:out:{{{job}}}" for job in jobs],
            *[f"inflight:out:{{{job}}}:owner" for job in jobs],
        )
        client.close()
    assert len(replies) == len(jobs)
    for events in replies.values():  # each job answered once: every seq once, one final event
        assert [e["seq"] for e in events[:-1]] == list(range(len(events) - 1))
        assert events[-1]["usage"]["completion_tokens"] == len(events) - 1
    served_by = [events[-1]["worker"] for events in replies.values()]
    assert {"left", "right"} == set(served_by), served_by  # both took a share
    assert pending == 0
