"""Following reply streams: every request's stream in one blocking XREAD.

A worker publishes a step's events for all its requests in one round trip; read one
XREAD per request, that step would wake as many blocked reads as there are streams,
each a reply to parse and a command to send. One reader asks for all of them at once
instead, remembering each stream's last entry id, and hands each stream's new entries to
its request. A new request must join a read that is already blocked: it rings this
gateway's doorbell (a one-entry stream the read also waits on), and the reader asks again
with the new stream included.

On a Redis Cluster one XREAD cannot name keys in different slots, so there each request
reads its own stream (`read_alone`).

Reading is resumable: from the last id seen, so a dropped connection or a Redis restart
costs a retry, not an event, and a worker's failover (another worker continues the same
reply stream, docs/protocol.md) is just a longer pause.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator

import structlog
from redis.exceptions import RedisError

from service.retry import FIRST_DELAY_S, is_transient, stop_if_cancelled
from service.text import text

log = structlog.get_logger("inflight.gateway")

# One blocking read's wait: how often an idle reader renews its read.
BLOCK_MS = 1000
# The most a retried read waits between tries while Redis is away.
MAX_RETRY_DELAY_S = 0.5
# The doorbell stream outlives a gateway that died without deleting it by this much.
DOORBELL_TTL_MS = 3_600_000

Entries = list[tuple[bytes, dict]]


class ReplyTimeout(Exception):
    """The reply stream stayed silent for `reply_timeout_s`."""


class _Follower:
    """One followed stream: where reading resumes, and what has come but not been taken."""

    def __init__(self) -> None:
        self.last: bytes | str = "0"
        self.arrived: asyncio.Queue[Entries | BaseException] = asyncio.Queue()


class ReplyReader:
    """One task reading every followed stream; `entries` is how a request reads its own."""

    def __init__(self, redis, namespace: str, block_ms: int = BLOCK_MS) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.doorbell = f"{namespace}:gateway:{uuid.uuid4().hex}:doorbell"
        self._doorbell_last: bytes | str = "$"
        self._following: dict[str, _Follower] = {}
        self._someone = asyncio.Event()  # a stream to follow, after none
        self._blocked = False  # a read is waiting in Redis
        self._rung = False  # the doorbell rang for the read now waiting

    async def entries(self, key: str, timeout_s: float) -> AsyncGenerator[Entries, None]:
        """The stream's entries as they land, in batches, until the caller stops; a batch
        does not come within `timeout_s` of the last → ReplyTimeout."""
        follower = self._following[key] = _Follower()
        self._someone.set()
        try:
            await self._ring()
            while True:
                try:
                    async with asyncio.timeout(timeout_s):
                        batch = await follower.arrived.get()
                except TimeoutError:
                    raise ReplyTimeout(f"no reply within {timeout_s:g} s") from None
                if isinstance(batch, BaseException):
                    raise batch
                yield batch
        finally:
            self._following.pop(key, None)

    async def run(self) -> None:
        """Read until `close`."""
        delay = FIRST_DELAY_S
        while True:
            if not self._following:
                self._someone.clear()
                await self._someone.wait()
            streams = {key: follower.last for key, follower in self._following.items()}
            streams[self.doorbell] = self._doorbell_last
            self._blocked, self._rung = True, False
            try:
                reply = await self.redis.xread(streams, block=self.block_ms)
                stop_if_cancelled()
            except RedisError as error:
                stop_if_cancelled()
                if is_transient(error):
                    await asyncio.sleep(delay)  # Redis away: read on from each `last` once it is back
                    delay = min(delay * 2, MAX_RETRY_DELAY_S)
                else:
                    self._fail_all(error)
                continue
            except Exception as error:  # noqa: BLE001 - a reader that died would leave every request waiting
                log.exception("reply_reader_failed")
                self._fail_all(error)
                await asyncio.sleep(delay)
                continue
            finally:
                self._blocked = False
            delay = FIRST_DELAY_S
            self._hand_out(reply or ())

    async def close(self, running: asyncio.Task) -> None:
        """End `running` (this reader's `run`) and delete the doorbell. The doorbell rings
        too: a cancel that lands as the read is sent can be swallowed (`wait_for` in
        redis-py, on Python 3.11), and the read would wait out its block first."""
        running.cancel()
        self._rung = False
        await self._ring()
        await asyncio.wait([running])
        try:
            await self.redis.delete(self.doorbell)
        except (RedisError, OSError):
            pass  # it expires

    async def _ring(self) -> None:
        """Wake a read that waits without the newest stream (once per such read)."""
        if not self._blocked or self._rung:
            return
        self._rung = True
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.doorbell, {"ring": 1}, maxlen=1, approximate=False)
                pipe.pexpire(self.doorbell, DOORBELL_TTL_MS)
                await pipe.execute()
        except RedisError:
            self._rung = False  # the read ends within BLOCK_MS anyway, and includes the stream then

    def _hand_out(self, reply) -> None:
        for key, entries in reply:
            key = text(key)
            if key == self.doorbell:
                self._doorbell_last = entries[-1][0]
                continue
            follower = self._following.get(key)
            if follower is not None:  # else its request ended meanwhile
                follower.last = entries[-1][0]
                follower.arrived.put_nowait(entries)

    def _fail_all(self, error: BaseException) -> None:
        """An error that retrying will not cure ends every request now following."""
        for follower in self._following.values():
            follower.arrived.put_nowait(error)
        self._following.clear()


async def read_alone(redis, key: str, timeout_s: float) -> AsyncGenerator[Entries, None]:
    """One stream's entries in batches, read by blocking XREADs of its own."""
    last: bytes | str = "0"
    heard = time.monotonic()
    delay = FIRST_DELAY_S
    while True:
        left_ms = (heard + timeout_s - time.monotonic()) * 1000
        if left_ms <= 0:
            raise ReplyTimeout(f"no reply within {timeout_s:g} s")
        try:
            reply = await redis.xread({key: last}, block=max(1, min(BLOCK_MS, int(left_ms))))
            stop_if_cancelled()
        except RedisError as error:
            stop_if_cancelled()
            if not is_transient(error):
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
            continue
        delay = FIRST_DELAY_S
        for _, entries in reply or ():
            heard = time.monotonic()
            last = entries[-1][0]
            yield entries
