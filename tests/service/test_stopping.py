"""Stopping cleanly in every state (issue 19), as a user meets it: Ctrl-C in a real
terminal, SIGTERM during a Redis outage, a SIGKILLed worker, and producers whose server
goes away or whose job no worker answers."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from bench.processes import RedisServer, free_port
from service.embedded import embedded_valkey
from service.sdk import Client, ReplyTimeout, ServerUnavailable, SyncClient
from tests.waiting import wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
BANNER_END = "Stop with Ctrl-C"
LONG = "1000"  # tokens: a request that no grace period in these tests lets finish


def gone(pid: int, within_s: float = 3.0) -> bool:
    """Whether the process has exited (or is a zombie) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def worker_argv(*options: str, grace_s: float = 30) -> list[str]:
    return [
        sys.executable,
        "-m",
        "service.cli",
        "worker",
        "--kv-memory-mb",
        "64",
        "--swap-memory-mb",
        "16",
        "--max-running-requests",
        "4",
        "--metrics-port",
        "0",
        "--shutdown-grace-s",
        str(grace_s),
        *options,
    ]


def embedded_options(tmp_path: Path) -> tuple[int, list[str]]:
    port = free_port()  # private: a developer's own `make run` is not disturbed
    return port, ["--embedded-port", str(port), "--embedded-data-dir", str(tmp_path / "valkey")]


def environment() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONUNBUFFERED": "1"}


def queue(client: redis.Redis, request_id: str, max_tokens: str, stream: str = "inflight:requests") -> bytes:
    return client.xadd(
        stream,
        {"id": request_id, "prompt": "Count from one to a thousand:", "max_tokens": max_tokens, "ignore_eos": "true"},
    )


def reply_types(client: redis.Redis, request_id: str) -> list[bytes]:
    return [fields[b"type"] for _, fields in client.xrange(f"inflight:out:{{{request_id}}}")]


def log_line(output: str, event: str) -> str:
    [line] = [line for line in output.splitlines() if event in line]
    return line


class Terminal:
    """A command in a pseudo-terminal, as in a user's shell: it leads a session of its own
    with the pty as its controlling terminal, so a written Ctrl-C (\\x03) makes the kernel
    send SIGINT to the terminal's foreground process group, and to nothing else."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = os.openpty()
        self.process = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=_take_controlling_terminal,
        )
        os.close(slave)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every holder of the terminal is gone
                return
            if not chunk:
                return
            self.output += chunk

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def expect(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.text:
            assert self.process.poll() is None, f"exited ({self.process.returncode}) before {text!r}:\n{self.text}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n{self.text}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.reader.join(timeout=2)
        os.close(self.master)


def _take_controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # As a shell in a terminal starts it: Ctrl-C with its default meaning, nothing blocked,
    # whatever the test process inherited or set up.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def open_terminal(argv: list[str]) -> Terminal:
        opened.append(Terminal(argv, environment()))
        return opened[-1]

    yield open_terminal
    for session in opened:
        session.close()


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of one test's own, on a free port; `kill()` takes it away."""
    with RedisServer(tmp_path / "redis", appendonly=False) as server:
        yield server


def connect(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        return False


def _server_pid(port: int) -> int:
    return redis.Redis(port=port).info("server")["process_id"]


# --- the worker, in a terminal ------------------------------------------------------


def start_in_terminal(terminal, tmp_path: Path, consumer: str, grace_s: float) -> tuple[Terminal, int, redis.Redis]:
    """`inflight worker` on a private embedded server, in a terminal, once it says it serves."""
    port, options = embedded_options(tmp_path)
    worker = terminal(worker_argv(*options, "--consumer", consumer, grace_s=grace_s))
    worker.expect(BANNER_END, 120)
    return worker, port, redis.Redis(port=port)


@pytest.mark.slow
def test_ctrl_c_finishes_the_request_in_flight_through_the_embedded_server_then_stops_both(terminal, tmp_path):
    worker, port, client = start_in_terminal(terminal, tmp_path, "ctrl-c", grace_s=30)
    server_pid = _server_pid(port)
    request_id = f"short-{uuid.uuid4().hex[:6]}"
    queue(client, request_id, "12")
    wait_until(lambda: len(reply_types(client, request_id)) >= 1, 60, "the first token")

    worker.ctrl_c()  # SIGINT to the terminal's foreground process group: the worker, not its server
    status = worker.process.wait(timeout=30 + 2)
    client.close()

    assert status == 0, worker.text  # drained completely
    assert gone(server_pid, within_s=0.5)  # stopped by the worker, after the drain
    with embedded_valkey(port, tmp_path / "valkey"):
        assert reply_types(redis.Redis(port=port), request_id) == [b"token"] * 12 + [b"done"], worker.text


@pytest.mark.slow
def test_ctrl_c_leaves_what_the_grace_period_cannot_finish_pending_for_a_restart(terminal, tmp_path):
    grace_s = 3.0
    worker, port, client = start_in_terminal(terminal, tmp_path, "grace", grace_s=grace_s)
    server_pid = _server_pid(port)
    request_id = f"long-{uuid.uuid4().hex[:6]}"
    entry = queue(client, request_id, LONG)
    wait_until(lambda: len(reply_types(client, request_id)) >= 1, 60, "the first token")
    client.close()

    worker.ctrl_c()
    pressed = time.monotonic()
    status = worker.process.wait(timeout=grace_s + 30)
    took = time.monotonic() - pressed

    assert status == 3, worker.text  # stopped with a job left pending
    assert took < grace_s + 2, f"{took:.1f} s: {worker.text}"
    assert request_id in log_line(worker.text, "worker_stopped")  # the log line names it
    assert gone(server_pid, within_s=0.5)
    with embedded_valkey(port, tmp_path / "valkey"):  # a restart, on the same append-only file
        after = redis.Redis(port=port)
        assert b"done" not in reply_types(after, request_id)
        pending = after.xpending_range("inflight:requests", "inflight", "-", "+", 10)
        assert [p["message_id"] for p in pending] == [entry]  # not acked: the next worker takes it over
        after.close()


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_and_the_embedded_server_goes_too(terminal, tmp_path):
    worker, port, client = start_in_terminal(terminal, tmp_path, "twice", grace_s=30)
    server_pid = _server_pid(port)
    request_id = f"long-{uuid.uuid4().hex[:6]}"
    entry = queue(client, request_id, LONG)
    wait_until(lambda: len(reply_types(client, request_id)) >= 2, 60, "the first tokens")
    client.close()

    worker.ctrl_c()
    worker.expect("worker_stopping", 10)  # draining now, with 30 s of grace
    worker.ctrl_c()
    pressed = time.monotonic()
    status = worker.process.wait(timeout=10)

    assert status == 130, worker.text
    assert time.monotonic() - pressed < 1.5
    assert "worker_forced_exit" in worker.text
    assert gone(server_pid)
    with embedded_valkey(port, tmp_path / "valkey"):
        after = redis.Redis(port=port)
        assert [p["message_id"] for p in after.xpending_range("inflight:requests", "inflight", "-", "+", 10)] == [entry]
        after.close()


# --- the worker, signalled ----------------------------------------------------------


@pytest.mark.slow
def test_sigterm_while_redis_is_down_exits_within_the_grace_period(private_redis, tmp_path):
    grace_s = 3.0
    log = tmp_path / "worker.log"
    with open(log, "wb") as output:
        worker = subprocess.Popen(
            worker_argv("--redis-url", private_redis.url, "--consumer", "outage", grace_s=grace_s),
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment(),
        )
    try:
        client = connect(private_redis)
        request_id = f"long-{uuid.uuid4().hex[:6]}"
        queue(client, request_id, LONG)
        wait_until(lambda: len(reply_types(client, request_id)) >= 2, 120, "the first tokens")
        client.close()
        private_redis.kill()
        wait_until(lambda: "redis_unavailable" in log.read_text(), 30, "the worker to meet the outage")

        worker.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        status = worker.wait(timeout=grace_s + 10)
        took = time.monotonic() - signalled
    finally:
        worker.kill()
        worker.wait()
    text = log.read_text()
    assert status == 3, text
    assert took < grace_s + 2, f"{took:.1f} s: {text}"
    assert request_id in log_line(text, "worker_stopped")  # the log line names what was left pending


@pytest.mark.slow
def test_a_sigkilled_worker_takes_its_embedded_server_down_cleanly(tmp_path):
    port, options = embedded_options(tmp_path)
    worker = subprocess.Popen(
        worker_argv(*options, "--consumer", "killed"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(),
    )
    try:
        banner = ""
        while BANNER_END not in banner:
            line = worker.stdout.readline()
            assert line, f"the worker exited: {banner}"
            banner += line
        client = redis.Redis(port=port)
        server_pid = _server_pid(port)
        client.xadd("kept", {"a": "b"})
        client.close()
        worker.kill()
        worker.wait()
    finally:
        worker.kill()
        worker.wait()

    assert gone(server_pid)  # not left on the port
    assert not _pings(port)
    assert "Received SIGTERM" in (tmp_path / "valkey" / "valkey.log").read_text()  # a clean shutdown
    with embedded_valkey(port, tmp_path / "valkey"):  # the next start finds its data
        assert redis.Redis(port=port).xlen("kept") == 1


def test_a_port_held_by_something_else_stops_the_worker_with_one_line(tmp_path):
    with socket.socket() as squatter:  # listens, never answers PING
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = subprocess.run(
            worker_argv("--embedded-port", str(port), "--embedded-data-dir", str(tmp_path / "valkey")),
            capture_output=True,
            text=True,
            timeout=60,
            env=environment(),
        )
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"inflight worker: the embedded Valkey server did not start on port {port} (")
    assert "Failed listening on port" in line  # Valkey's own reason
    assert line.endswith("; choose another --embedded-port or set REDIS_URL")


# --- producers ----------------------------------------------------------------------


def submit_argv(url: str, stream: str, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "service.cli",
        "submit",
        "Hello",
        "--redis-url",
        url,
        "--requests-stream",
        stream,
        *options,
    ]


def test_submit_says_in_one_line_that_the_server_went_away(private_redis):
    client = connect(private_redis)
    submit = subprocess.Popen(
        submit_argv(private_redis.url, "inflight:requests", "--timeout-s", "30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: client.xlen("inflight:requests") == 1, 30, "the job")
    private_redis.kill()
    _, errors = submit.communicate(timeout=15)

    assert submit.returncode == 1
    assert errors.splitlines() == [errors.strip()], errors  # one line, no traceback
    assert errors.startswith(f"inflight submit: Redis at {private_redis.url} is unavailable")


def test_submit_says_in_one_line_that_nothing_answers_a_server_that_is_not_there():
    url = f"redis://127.0.0.1:{free_port()}"
    result = subprocess.run(submit_argv(url, "inflight:requests"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"inflight submit: Redis at {url} is unavailable: "
        f"Error 111 connecting to 127.0.0.1:{url.rsplit(':', 1)[1]}. Connection refused."
    ]


def test_submit_gives_up_after_its_timeout_when_no_worker_answers():
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    started = time.monotonic()
    result = subprocess.run(
        submit_argv("redis://127.0.0.1:6379", stream, "--timeout-s", "1"), capture_output=True, text=True, timeout=30
    )
    took = time.monotonic() - started
    redis.Redis(port=6379).delete(stream)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("inflight submit: no reply to request ") and "within 1 s" in line
    assert f"no worker is serving {stream} on redis://127.0.0.1:6379, or it stopped (the job stays queued)" in line
    # It waited its second, and gave up rather than waiting on (the subprocess timeout
    # bounds the rest; the interpreter's start varies with the machine's load).
    assert took >= 1


def test_ctrl_c_on_a_waiting_submit_exits_130_without_a_traceback(terminal):
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    client = redis.Redis(port=6379)
    # As when the suite itself runs in the background (`make test &` from a script):
    # SIGINT ignored here, which a child would inherit, and a Python started so installs
    # no KeyboardInterrupt; the terminal must start its program as a shell would.
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        # A reply timeout far past the wait below: an ignored Ctrl-C shows as a hang.
        submit = terminal(submit_argv("redis://127.0.0.1:6379", stream, "--timeout-s", "300"))
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        wait_until(lambda: client.xlen(stream) == 1, 30, "the job")
        submit.ctrl_c()
        status = submit.process.wait(timeout=30)  # a loaded CI machine can take seconds
    finally:
        client.delete(stream)
        client.close()
    assert status == 130
    assert "Traceback" not in submit.text


def _collect_sync(url: str, stream: str, timeout_s: float | None) -> list[dict]:
    with SyncClient(url, requests_stream=stream, reply_timeout_s=timeout_s, block_ms=200) as client:
        return list(client.generate("Hello", max_tokens=4))


def _collect_async(url: str, stream: str, timeout_s: float | None) -> list[dict]:
    async def collect():
        async with Client(url, requests_stream=stream, reply_timeout_s=timeout_s, block_ms=200) as client:
            return [event async for event in client.generate("Hello", max_tokens=4)]

    return asyncio.run(collect())


@pytest.mark.parametrize("collect", [_collect_sync, _collect_async], ids=["SyncClient", "Client"])
def test_the_sdk_raises_server_unavailable_when_the_server_goes_away(collect, private_redis):
    watcher = connect(private_redis)

    def kill_once_submitted() -> None:
        wait_until(lambda: watcher.xlen("inflight:requests") == 1, 30, "the job")
        private_redis.kill()  # while it waits for events

    killer = threading.Thread(target=kill_once_submitted)
    killer.start()
    with pytest.raises(ServerUnavailable, match=f"^Redis at {private_redis.url} is unavailable: "):
        collect(private_redis.url, "inflight:requests", None)
    killer.join()
    watcher.close()
    with pytest.raises(ServerUnavailable, match="Error 111 connecting"):  # and before it could submit
        collect(private_redis.url, "inflight:requests", None)


@pytest.mark.parametrize("collect", [_collect_sync, _collect_async], ids=["SyncClient", "Client"])
def test_the_sdk_raises_reply_timeout_when_no_worker_answers(collect):
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    started = time.monotonic()
    try:
        with pytest.raises(ReplyTimeout, match=f"within 0.5 s: no worker is serving {stream}"):
            collect("redis://127.0.0.1:6379", stream, 0.5)
    finally:
        redis.Redis(port=6379).delete(stream)
    assert 0.5 <= time.monotonic() - started < 1.5


def example_argv(name: str) -> tuple[list[str], Path]:
    if name == "redis-cli":
        return ["bash", str(EXAMPLES / "redis-cli.sh"), "The capital of France is"], EXAMPLES
    assert (EXAMPLES / "node" / "node_modules").is_dir(), "`make test` installs the example's packages (npm ci)"
    return [shutil.which("node") or "node", "generate.mjs"], EXAMPLES / "node"


@pytest.mark.parametrize("example", ["redis-cli", "node"])
def test_an_example_says_in_one_line_that_the_server_went_away(example, private_redis):
    argv, cwd = example_argv(example)
    client = connect(private_redis)
    run = subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REDIS_URL": private_redis.url, "INFLIGHT_REQUESTS": "inflight:requests"},
    )
    wait_until(lambda: client.xlen("inflight:requests") == 1, 30, "the job")
    private_redis.kill()
    _, errors = run.communicate(timeout=15)
    assert run.returncode == 1
    assert errors.splitlines() == [errors.strip()], errors
    assert errors.startswith(f"Redis at {private_redis.url} is unavailable: ")


@pytest.mark.parametrize("example", ["redis-cli", "node"])
def test_an_example_gives_up_after_its_timeout_when_no_worker_answers(example):
    argv, cwd = example_argv(example)
    stream = f"inflight:test:{uuid.uuid4().hex[:8]}:requests"
    try:
        result = subprocess.run(
            argv,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            env={
                **os.environ,
                "REDIS_URL": "redis://127.0.0.1:6379",
                "INFLIGHT_REQUESTS": stream,
                "INFLIGHT_TIMEOUT_S": "1",
            },
        )
    finally:
        redis.Redis(port=6379).delete(stream)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("no reply to ") and f"no worker is serving {stream}, or it stopped" in line
