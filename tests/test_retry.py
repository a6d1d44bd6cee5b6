"""The one retry policy, against a real private redis-server: an outage is waited out,
credentials and permissions are never retried, and a cancellation always ends the call."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from service.retry import retrying


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrivateRedis:
    """A redis-server the test starts and stops; `limited` may only touch `allowed:*`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--user", "limited", "on", ">secret", "~allowed:*", "+@all"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def client(self, **login) -> aioredis.Redis:
        return aioredis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **login)


@pytest.fixture
def server():
    server = PrivateRedis()
    yield server
    server.stop()


def test_an_outage_is_waited_out_until_redis_answers(server):
    async def main():
        client = server.client()
        call = asyncio.create_task(retrying(lambda: client.set("allowed:k", "v")))
        await asyncio.sleep(0.5)  # refused connections, retried with backoff
        assert not call.done()
        server.start()
        await asyncio.wait_for(call, timeout=10)
        value = await client.get("allowed:k")
        await client.aclose()
        return value

    assert asyncio.run(main()) == b"v"


def test_wrong_credentials_and_missing_permissions_are_never_retried(server):
    server.start()

    async def main():
        wrong = server.client(username="limited", password="wrong")
        limited = server.client(username="limited", password="secret")
        with pytest.raises(AuthenticationError):
            await asyncio.wait_for(retrying(lambda: wrong.ping()), timeout=5)
        with pytest.raises(NoPermissionError):
            await asyncio.wait_for(retrying(lambda: limited.set("forbidden:k", "v")), timeout=5)
        with pytest.raises(ResponseError, match="WRONGTYPE"):  # a per-request error: the caller's to handle
            await limited.set("allowed:s", "v")
            await asyncio.wait_for(retrying(lambda: limited.xadd("allowed:s", {"a": "b"})), timeout=5)
        await wrong.aclose()
        await limited.aclose()

    asyncio.run(main())


def test_a_cancelled_call_stops_retrying_at_once(server):
    """Redis away: a task retrying a call ends as soon as it is cancelled."""
    async def main():
        client = server.client()
        loops = [asyncio.create_task(retrying(lambda: client.xread({"allowed:s": "$"}, block=200)))
                 for _ in range(5)]
        await asyncio.sleep(0.3)
        for task in loops:
            task.cancel()
        done, pending = await asyncio.wait(loops, timeout=2)
        await client.aclose()
        return done, pending

    done, pending = asyncio.run(main())
    assert not pending and all(task.cancelled() for task in done)
