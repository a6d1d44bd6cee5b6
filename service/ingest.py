"""Reads jobs from the request stream through a consumer group (docs/protocol.md).

Queue semantics:
- a worker reads under a stable consumer name; on start it first re-reads its own
  pending entries (delivered to it before a restart, never acked), then new ones;
- entries left pending longer than `claim_idle_ms` by any consumer (a dead worker) are
  taken over with XAUTOCLAIM;
- the caller asks for at most as many entries as it can take (backpressure), so idle
  workers get the rest;
- an entry is acked once its final event is published; an entry delivered more than
  `max_deliveries` times, or one that cannot be decoded, goes to the dead-letter stream
  with its error, and is acked there.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import ResponseError


@dataclass(frozen=True)
class Entry:
    entry_id: str
    fields: dict  # bytes -> bytes, as Redis returns them
    deliveries: int  # how many times it has been delivered, this delivery included


class JobReader:
    def __init__(self, redis, stream: str, group: str, consumer: str, dead_letter_stream: str,
                 claim_idle_ms: int, max_deliveries: int) -> None:
        self.redis = redis  # a redis.asyncio.Redis whose socket timeout exceeds any BLOCK
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._own_pending_done = False

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` entries: this consumer's own pending ones first (once, after a
        restart), then entries idle past `claim_idle_ms`, then new ones (waiting up to
        `block_ms` for them)."""
        if count <= 0:
            return []
        if not self._own_pending_done:
            entries = await self._read_group("0", count, block_ms=None)
            if len(entries) < count:
                self._own_pending_done = True  # everything it had is in hand
            if entries:
                return await self._with_deliveries(entries)
        try:
            _, claimed, _ = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, start_id="0-0", count=count
            )
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            claimed = []
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields]  # deleted entries come back empty
        if claimed:
            return await self._with_deliveries(claimed)
        # A new entry is on its first delivery: no need to ask Redis.
        return [Entry(_text(entry_id), fields, 1) for entry_id, fields in await self._read_group(">", count, block_ms)]

    async def ack(self, entry_id: str) -> None:
        await self.redis.xack(self.stream, self.group, entry_id)

    async def dead_letter(self, entry: Entry, code: str, message: str) -> None:
        """Park the entry, with why, on the dead-letter stream, and ack it here."""
        record = {"entry_id": entry.entry_id, "stream": self.stream, "code": code, "message": message,
                  "deliveries": str(entry.deliveries), "consumer": self.consumer}
        record.update({f"field:{_text(k)}": v for k, v in entry.fields.items()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_letter_stream, record)
            pipe.xack(self.stream, self.group, entry.entry_id)
            await pipe.execute()

    async def _read_group(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, dict]]:
        try:
            reply = await self.redis.xreadgroup(self.group, self.consumer, {self.stream: start}, count=count,
                                                block=block_ms)
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self.ensure_group()  # a Redis restarted without persistence lost it
            return []
        return [(entry_id, fields) for _, entries in reply or [] for entry_id, fields in entries if fields]

    async def _with_deliveries(self, entries: list[tuple]) -> list[Entry]:
        if not entries:
            return []
        ids = [_text(entry_id) for entry_id, _ in entries]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:  # one round trip for all of them
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            pending = await pipe.execute()
        deliveries = [rows[0]["times_delivered"] if rows else 1 for rows in pending]
        return [Entry(entry_id, fields, n) for entry_id, (_, fields), n in zip(ids, entries, deliveries)]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value

