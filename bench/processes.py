"""Real processes for the load scenarios and tests: a private `redis-server` (or a Redis
Cluster of three) that can be stopped or killed and started again on the same port and
data, and `inflight worker`/`gateway` processes restarted under the same name."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # bench/ sits at the root


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(
    ready: Callable[[], bool],
    process: subprocess.Popen,
    timeout_s: float,
    failed: Callable[[], str],
    interval_s: float = 0.05,
) -> None:
    """Poll `ready()` until it holds; raise `failed()` once `process` exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(failed())
        time.sleep(interval_s)


def start_reaper(targets: list[str]) -> subprocess.Popen:
    """A watcher that SIGKILLs `targets` (pids, or -pgid) once this process is gone without
    its `finally` blocks running (SIGKILL). vLLM's server ignores SIGTERM while it starts."""
    return subprocess.Popen(
        ["sh", "-c", f"tail --pid={os.getpid()} -f /dev/null; kill -KILL {' '.join(targets)}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_reaper(reaper: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(reaper.pid, signal.SIGKILL)  # its shell and its tail
    reaper.wait(timeout=30)


class _Child:
    """One child process that may be stopped (SIGTERM, SIGKILL after `STOP_WAIT_S`) or
    killed, and started again."""

    STOP_WAIT_S = 60.0
    _process: subprocess.Popen | None = None

    @property
    def process(self) -> subprocess.Popen:
        assert self._process is not None, "not started"
        return self._process

    @process.setter
    def process(self, process: subprocess.Popen) -> None:
        self._process = process

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL: gone at once, as in a crash."""
        if self.alive():
            self.process.kill()
        if self._process is not None:
            self.process.wait(timeout=60)


class RedisServer(_Child):
    """A `redis-server` of our own on a free port, writing into `data_dir` (its log, and its
    append-only file when `appendonly`). `args` go to redis-server as they are (e.g. ACL
    `--user` lines); `username`/`password` are what the readiness check logs in with, and go
    into `url`. With `tls_ca` (the server's certificate and key in `args`), it speaks TLS
    only. `start()` returns once it answers PING (its data loaded)."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendonly: bool = True,
        args: tuple[str, ...] = (),
        username: str | None = None,
        password: str | None = None,
        tls_ca: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.args = tuple(args)
        self.username, self.password, self.tls_ca = username, password, tls_ca

    @property
    def url(self) -> str:
        login = f"{self.username or ''}:{self.password}@" if self.password is not None else ""
        if self.tls_ca is not None:
            return f"rediss://{login}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_ca}"
        return f"redis://{login}127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "redis.log"
        ports = ["--port", str(self.port)] if self.tls_ca is None else ["--port", "0", "--tls-port", str(self.port)]
        persistence = ["--appendonly", "yes" if self.appendonly else "no", "--save", ""]
        argv = ["redis-server", *ports, "--bind", "127.0.0.1", "--dir", str(self.data_dir), *persistence, *self.args]
        with open(log_path, "a") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        failed = f"redis-server did not start on port {self.port}: "
        pong = functools.partial(self._replies, "PING", b"+PONG")  # also waits out loading (-LOADING)
        try:
            wait_for(pong, self.process, timeout_s, lambda: failed + log_path.read_text()[-2000:])
        except RuntimeError:
            self.kill()
            raise

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file out and exits."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()

    def _replies(self, command: str, expected: bytes, *more: str) -> bool:
        try:
            return expected in self.info(command, *more)
        except OSError:
            return False

    def info(self, *command: str) -> bytes:
        """The raw reply to one command, logged in as the readiness check is: a bulk string's
        payload (INFO, CLUSTER INFO), else its status or error line."""
        login = () if self.password is None else (_command("AUTH", self.username or "default", self.password),)
        connection = socket.create_connection(("127.0.0.1", self.port), timeout=1)
        if self.tls_ca is not None:
            tls = ssl.create_default_context(cafile=str(self.tls_ca))
            connection = tls.wrap_socket(connection, server_hostname="127.0.0.1")
        with connection:
            connection.sendall(b"".join(login) + _command(*command))
            reply = b""
            while True:
                answer = reply.split(b"\r\n")[len(login) :]
                if len(answer) >= 2 and answer[0][:1] in (b"+", b"-"):
                    return answer[0]
                if len(answer) >= 2 and answer[0][:1] == b"$" and len(b"\r\n".join(answer[1:])) >= int(answer[0][1:]):
                    return b"\r\n".join(answer[1:])
                chunk = connection.recv(4096)
                if not chunk:
                    return reply
                reply += chunk


def _command(*parts: str) -> bytes:
    encoded = [part.encode() for part in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in encoded)


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) exists and is free too."""
    while True:
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as probe:
            if port + 10000 <= 65535:
                probe.bind(("127.0.0.1", port + 10000))
                return port


class RedisClusterServers:
    """A Redis Cluster of `masters` redis-servers of our own (no replicas, no persistence),
    each in a folder of its own under `data_dir`, joined by `redis-cli --cluster create`.
    `start()` returns once every node says `cluster_state:ok`; `url` is the
    `redis+cluster://` URL of the first node (the client finds the others)."""

    def __init__(
        self,
        data_dir: Path,
        masters: int = 3,
        args: tuple[str, ...] = (),
        username: str | None = None,
        password: str | None = None,
        tls_ca: Path | None = None,
    ) -> None:
        cluster = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000")
        login = (username, password, tls_ca)
        self.nodes = [
            RedisServer(Path(data_dir) / f"node-{i}", free_cluster_port(), False, (*cluster, *args), *login)
            for i in range(masters)
        ]
        self.username, self.password, self.tls_ca = username, password, tls_ca

    @property
    def url(self) -> str:
        """The first node's URL as `redis+cluster://` (`rediss+cluster://` over TLS)."""
        return self.nodes[0].url.replace("redis://", "redis+cluster://").replace("rediss://", "rediss+cluster://")

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self, timeout_s: float = 60.0) -> None:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            login = [] if self.password is None else ["--user", self.username or "default", "--pass", self.password]
            tls = [] if self.tls_ca is None else ["--tls", "--cacert", str(self.tls_ca)]
            nodes = [f"127.0.0.1:{port}" for port in self.ports]
            create = ["redis-cli", *login, *tls, "--cluster", "create", *nodes, "--cluster-replicas", "0"]
            created = subprocess.run([*create, "--cluster-yes"], capture_output=True, text=True, timeout=timeout_s)
            if created.returncode != 0:
                failed = f"redis-cli --cluster create failed: {created.stdout[-2000:]}{created.stderr[-2000:]}"
                raise RuntimeError(failed)

            def agreed() -> bool:  # the nodes agree by gossip
                return all(node._replies("CLUSTER", b"cluster_state:ok", "INFO") for node in self.nodes)

            timed_out = f"the cluster on {self.ports} did not reach cluster_state:ok"
            wait_for(agreed, self.nodes[0].process, timeout_s, lambda: timed_out)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> RedisClusterServers:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()


class ServiceProcess(_Child):
    """`python -m service.cli COMMAND` under a name, logging to `log_dir/COMMAND-NAME.log`;
    it may be stopped or killed and started again with the same flags. `env` adds to the
    environment (e.g. INFLIGHT_API_KEYS)."""

    STOP_WAIT_S = 30.0  # after SIGTERM, before SIGKILL

    def __init__(self, command: str, name: str, argv: list[str], log_dir: Path, env: dict | None = None) -> None:
        self.name, self.command = name, command
        self.argv = [sys.executable, "-m", "service.cli", command, *argv]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(log_dir) / f"{command}-{name}.log"

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait(self, ready: Callable[[], bool], timeout_s: float, interval_s: float) -> None:
        failed = f"{self.command} {self.name} did not start:\n"
        wait_for(ready, self.process, timeout_s, lambda: failed + self.log_tail(), interval_s)


class WorkerProcess(ServiceProcess):
    """`inflight worker` under a fixed consumer name (its restarts too), /metrics on a free port."""

    STOP_WAIT_S = 60.0

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.metrics_port = free_port()
        metrics = ["--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        super().__init__("worker", name, ["--consumer", name, *metrics, *argv], log_dir)
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"--- start {self.starts}\n")  # what wait_ready reads after
        super().start()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until this start has logged `worker_started` (model loaded, serving)."""

        def started() -> bool:
            this_start = self.log_path.read_text(errors="replace").rsplit(f"--- start {self.starts}\n", 1)[-1]
            return '"worker_started"' in this_start

        self._wait(started, timeout_s, 0.1)

    def rss_kb(self) -> int:
        """VmRSS from /proc: what the process holds in memory now."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """The worker's /metrics as {(name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


class GatewayProcess(ServiceProcess):
    """`inflight gateway` on a free port, logging JSON lines."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        flags = ["--host", "127.0.0.1", "--port", str(self.port), "--log-format", "json"]
        super().__init__("gateway", name, [*flags, *argv], log_dir, env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until it answers HTTP (its /health may say Redis is down: that is an answer too)."""
        self._wait(lambda: answers_http(f"{self.url}/health", timeout_s=2), timeout_s, 0.05)


def answers_http(url: str, timeout_s: float, healthy: bool = False) -> bool:
    """Whether `url` answers at all (with `healthy`: answers 200)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200 or not healthy
    except urllib.error.HTTPError:
        return not healthy
    except OSError:
        return False
