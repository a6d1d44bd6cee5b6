"""Writes a request's events to its reply stream (docs/protocol.md, "Replies"), fenced by
an owner key so that two workers never both write one stream.

A reply stream belongs to one job. Its owner key, `<reply_to>:owner`, names that job's
request-stream entry and the worker serving it. A worker first `claim`s the stream:
- nothing there yet: the stream is this job's;
- the key names this job's entry (a takeover, or this worker restarted): it becomes the
  new owner, and gets back what the stream already holds, to continue from;
- the key names another entry, or the stream exists without one: another job owns it
  (`duplicate_id`); this job writes nothing there.
Every write then checks the owner key in the same script as the XADD, so a worker that
lost the job (paused, partitioned, slow) is refused on its next write, and stops. Both
keys share a hash slot (the owner key only appends to the stream's name), as a Redis
Cluster script requires.

Entry ids are derived from the event, not the clock: token `seq` is `<seq + 1>-0`, and
the final event after n tokens is `<n>-1`. So a write is idempotent: one retried after
a dropped connection that had in fact landed is refused by Redis as "equal or smaller"
and taken as done, and a pipeline that partly landed can be sent again whole.

`append` is the hot path: the events of many streams (everything one engine step, or a
few, produced) in one pipelined round trip, one script call per stream. A write sets
both keys' TTL only when asked to (`Append.refresh_ttl`): at a stream's first and final
events, and at a bounded rate in between (`service/outbox.py`), so a stream nobody reads
expires `ttl_s` after its final event, and never while it is still being written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisError, ResponseError

from service.lua_scripts import lua
from service.protocol import done_fields, error_fields, hash_tag
from service.retry import is_transient
from workers.api import FinalEvent

# The scripts, each described at the top of its file in service/lua/.
CLAIM = lua("publish_claim")
STALLED_DELIVERIES = lua("publish_stalled_deliveries")
FENCED_APPEND = lua("publish_fenced_append")
# Streams per script call: one call holds Redis for its whole length.
STREAMS_PER_CALL = 128


@dataclass(frozen=True)
class Gap:
    """The stream holds only `have` token events, fewer than were written to it: a
    failover of Redis lost the rest (asynchronous replication). Nothing was written."""

    have: int


class LeaseLost(Exception):
    """Another worker serves this job now; this one must stop writing and generating."""


@functools.lru_cache(maxsize=1 << 16)  # asked again for every stream at every step
def owner_key(reply_to: str) -> str:
    """`<reply_to>:owner`, in the reply stream's hash slot: a `reply_to` without a hash
    tag is wrapped in one (`{<reply_to>}:owner`), as a Redis Cluster script needs."""
    return _beside(reply_to, "owner")


def progress_key(reply_to: str) -> str:
    """`<reply_to>:progress`, in the reply stream's hash slot (as `owner_key`): where the
    stream stood at its job's last takeover, for the poison-job guard."""
    return _beside(reply_to, "progress")


def _beside(reply_to: str, suffix: str) -> str:
    return f"{reply_to}:{suffix}" if hash_tag(reply_to) else f"{{{reply_to}}}:{suffix}"


@dataclass(frozen=True)
class Append:
    """Events for one reply stream, in order: token events as their msgpack `data`
    (`service.protocol.token_data`), then maybe the final event as (entry id, fields)."""

    reply_to: str
    entry_id: str  # the job's request-stream entry: whose owner value fences the write
    tokens: Sequence[bytes]
    final: tuple[str, dict] | None
    refresh_ttl: bool
    written: int = 0  # token events this writer wrote before these (0: none, or it does not know)


@dataclass(frozen=True)
class Claim:
    owned: bool  # False: another job owns the stream (duplicate id or reply_to)
    # Already published, by choice index (0 unless n > 1), in seq order: a takeover
    # continues after them.
    choices: dict[int, list[int]]
    num_events: int  # token events already there: the next one's seq
    finished: bool  # a final event is already there: nothing is left to do

    @property
    def token_ids(self) -> list[int]:
        """Choice 0's tokens: all of them when n is 1."""
        return self.choices.get(0, [])


class ReplyPublisher:
    def __init__(self, redis, ttl_s: int, worker: str = "") -> None:
        self.redis = redis  # a redis.asyncio.Redis
        self.ttl_s = ttl_s
        self.worker = worker  # named on done events: which consumer finished the request
        self.incarnation = os.urandom(6).hex()  # two processes under one name still differ
        self._claim = redis.register_script(CLAIM)
        self._stalled_deliveries = redis.register_script(STALLED_DELIVERIES)
        self._append_sha = redis.register_script(FENCED_APPEND).sha
        self.cluster = isinstance(redis, RedisCluster)

    def owner(self, entry_id: str) -> str:
        return f"{entry_id} {self.worker} {self.incarnation}"

    async def claim(self, reply_to: str, entry_id: str) -> Claim:
        """Take `reply_to` for the job in entry `entry_id` (see the module docstring)."""
        reply = await self._claim(
            keys=[reply_to, owner_key(reply_to)], args=[entry_id, self.owner(entry_id), self.ttl_s]
        )
        if not reply[0]:
            return Claim(False, {}, 0, False)
        choices: dict[int, list[int]] = {}
        num_events = 0
        finished = False
        for _, fields in _pairs(reply[1]):
            data = msgpack.unpackb(fields[b"data"])
            if data["type"] == "token":
                choices.setdefault(data.get("index", 0), []).extend(data["token_ids"])
                num_events += 1
            else:
                finished = True
        return Claim(True, choices, num_events, finished)

    async def stalled_deliveries(self, reply_to: str, num_events: int, deliveries: int) -> int:
        """At a takeover: how many of the job's deliveries in a row, counting back from the
        last one, ended with no new token on `reply_to` (its workers died, or were taken
        over from, without making progress). A job that kills every worker that runs it
        stalls every time; one whose workers die of other causes moves on between them."""
        return int(
            await self._stalled_deliveries(keys=[progress_key(reply_to)], args=[num_events, deliveries, self.ttl_s])
        )

    async def append(self, appends: Sequence[Append]) -> list[bool | Gap | RedisError]:
        """Write every `Append` in one pipelined round trip. Per append: True when written,
        False when this worker no longer owns the stream, a `Gap` when the stream lost
        events written before (nothing written), or the error Redis answered for that
        stream alone (WRONGTYPE, OOM). Raises when Redis cannot be reached (then the whole
        call may be retried: the writes are idempotent)."""
        calls = self._calls(appends)
        replies = await self._append_pipelined(calls, appends)
        if any(isinstance(reply, NoScriptError) for reply in replies):
            # First use, or a server (a cluster node) restarted and forgot it: EVALSHA in a
            # pipeline does not load its script. SCRIPT LOAD reaches every cluster master.
            await self.redis.script_load(FENCED_APPEND)
            replies = await self._append_pipelined(calls, appends)
        for reply in replies:
            if isinstance(reply, RedisError) and is_transient(reply):
                raise reply  # a node away: the caller retries the whole append
        results: dict[int, bool | Gap | RedisError] = {}
        for call, reply in zip(calls, replies):
            if isinstance(reply, RedisError):  # the whole call failed, e.g. OOM
                results.update((index, reply) for index in call)
                continue
            for index, result in zip(call, reply):
                if isinstance(result, bytes):
                    results[index] = ResponseError(result.decode(errors="replace"))
                else:
                    results[index] = Gap(-1 - result) if result < 0 else bool(result)
        return [results[index] for index in range(len(appends))]

    def _calls(self, appends: Sequence[Append]) -> list[list[int]]:
        """The appends' indices, grouped into script calls: every key of one call must
        lie in one hash slot on a Redis Cluster; any mix will do on a single server."""
        groups: dict[int, list[int]] = {}
        for index, append in enumerate(appends):
            slot = key_slot(append.reply_to.encode()) if self.cluster else 0
            groups.setdefault(slot, []).append(index)
        return [
            group[start : start + STREAMS_PER_CALL]
            for group in groups.values()
            for start in range(0, len(group), STREAMS_PER_CALL)
        ]

    async def _append_pipelined(self, calls: list[list[int]], appends: Sequence[Append]) -> list:
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                keys: list[str] = []
                specs: list[tuple] = []
                for index in call:
                    append = appends[index]
                    keys += (append.reply_to, owner_key(append.reply_to))
                    event_id, fields = append.final or ("", {})
                    specs.append(
                        (
                            self.owner(append.entry_id),
                            self.ttl_s if append.refresh_ttl else 0,
                            append.tokens,
                            event_id,
                            [part for pair in fields.items() for part in pair],
                            append.written,
                            self.ttl_s,
                        )
                    )
                # The old msgpack format (no bin, no str8), the one Redis's Lua cmsgpack reads.
                # execute_command: a cluster pipeline refuses pipe.evalsha, and routes this by its keys.
                pipe.execute_command(
                    "EVALSHA", self._append_sha, len(keys), *keys, msgpack.packb(specs, use_bin_type=False)
                )
            return await pipe.execute(raise_on_error=False)

    async def done(self, reply_to: str, entry_id: str, event: FinalEvent, num_tokens: int) -> None:
        """The final event, after `num_tokens` token events."""
        await self._write(reply_to, entry_id, f"{num_tokens}-1", done_fields(event, self.worker))

    async def error(
        self,
        reply_to: str,
        entry_id: str,
        code: str,
        message: str,
        num_tokens: int = 0,
        retry_after_s: float | None = None,
    ) -> None:
        await self._write(reply_to, entry_id, f"{num_tokens}-1", error_fields(code, message, retry_after_s))

    async def _write(self, reply_to: str, entry_id: str, event_id: str, fields: dict) -> None:
        """One fenced event; raises `LeaseLost` when this worker no longer owns the stream."""
        (written,) = await self.append([Append(reply_to, entry_id, (), (event_id, fields), refresh_ttl=True)])
        if isinstance(written, RedisError):
            raise written
        if not written:
            raise LeaseLost(reply_to)


def _pairs(flat_entries):
    """XRANGE as returned inside a script: [[id, [field, value, ...]], ...]."""
    for entry_id, flat in flat_entries:
        yield entry_id, dict(zip(flat[::2], flat[1::2]))
