"""The one retry policy, against a real private redis-server: an outage is waited out,
credentials and permissions are never retried, and a cancellation always ends the call."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from structlog.testing import capture_logs

from bench.processes import RedisServer
from service.retry import retrying
from tests.waiting import eventually


@pytest.fixture
def server(tmp_path):
    """A redis-server the test starts (not yet started); `limited` may only touch `allowed:*`."""
    server = RedisServer(tmp_path, appendonly=False, args=("--user", "limited", "on", ">secret", "~allowed:*", "+@all"))
    yield server
    server.kill()


def client(server: RedisServer, **login) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5, **login)


def outages_logged(logs: list[dict]) -> int:
    return sum(1 for entry in logs if entry["event"] == "redis_unavailable")


def test_an_outage_is_waited_out_until_redis_answers(server):
    async def main():
        redis_client = client(server)
        with capture_logs() as logs:
            call = asyncio.create_task(retrying(lambda: redis_client.set("allowed:k", "v")))
            await eventually(lambda: outages_logged(logs) == 1, 10, "the call to meet a refused connection")
            assert not call.done()  # refused, and retrying with backoff
            await asyncio.to_thread(server.start)
            await asyncio.wait_for(call, timeout=10)
        value = await redis_client.get("allowed:k")
        await redis_client.aclose()
        return value, logs

    value, logs = asyncio.run(main())
    assert value == b"v"
    assert [entry["event"] for entry in logs] == ["redis_unavailable", "redis_recovered"]  # once per outage


def test_wrong_credentials_and_missing_permissions_are_never_retried(server):
    server.start()

    async def main():
        wrong = client(server, username="limited", password="wrong")
        limited = client(server, username="limited", password="secret")
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
    """Redis away: a task retrying a call ends as soon as it is cancelled, whether the
    cancel finds it inside redis-py's own connection attempts or in our backoff."""

    async def main():
        redis_client = client(server)
        with capture_logs() as logs:

            def loop():
                return asyncio.create_task(retrying(lambda: redis_client.xread({"allowed:s": "$"}, block=200)))

            connecting = [loop() for _ in range(5)]
            backing_off = [loop() for _ in range(5)]
            await asyncio.sleep(0)  # every task runs into its first connection attempt
            for task in connecting:
                task.cancel()
            done_connecting, pending_connecting = await asyncio.wait(connecting, timeout=2)
            assert outages_logged(logs) == 0  # a cancelled call never reports an outage
            await eventually(lambda: outages_logged(logs) == 5, 30, "the other tasks to meet the outage")
            assert not any(task.done() for task in backing_off)  # all retrying
            for task in backing_off:
                task.cancel()
            done, pending = await asyncio.wait(backing_off, timeout=2)
        await redis_client.aclose()
        return done_connecting | done, pending_connecting | pending

    done, pending = asyncio.run(main())
    assert not pending and len(done) == 10 and all(task.cancelled() for task in done)
