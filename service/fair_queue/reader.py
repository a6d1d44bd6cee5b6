"""Takes admitted jobs from the tenant queues in fair order: the worker's reader with
`--fair-queue` (service/lua/fair_queue_take.lua picks them)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Collection

import msgpack
from redis.exceptions import ResponseError

from service.config import FairQueueConfig, RedisConfig
from service.fair_queue.keys import AHEAD_FIELD, BATCH_LEVEL, ORIGIN_FIELD, PROMPT_IDS_FIELD, TOKENS_FIELD, tag_of
from service.fair_queue.scripts import ADMITTING, TAKE
from service.ingest import Entry, JobReader, LeasedReader, dead_letter_record
from service.text import text

# While a take waits for a burst to be admitted, it looks again this often.
ADMITTING_POLL_S = 0.01


class FairQueueReader(LeasedReader):
    """Takes admitted jobs from the tenant queues, in fair order; the worker's reader.

    Same calls as `JobReader`, by the job's request entry id (an `Entry`'s `entry_id` is
    the origin); it remembers which tenant queue entry each one is.
    """

    def __init__(self, redis, config: RedisConfig, fair: FairQueueConfig, priority_step_s: float) -> None:
        super().__init__(redis, config)
        self.config = config
        self.fair = fair
        self._priority_step_ms = priority_step_s * 1000
        self._tag = tag_of(self.stream)
        self._take = redis.register_script(TAKE)
        self._admitting = redis.register_script(ADMITTING)
        self._where: dict[str, tuple[str, str]] = {}  # origin -> (tenant queue, its entry id)

    async def ensure_group(self) -> None:
        await JobReader(self.redis, self.config).ensure_group()

    async def read(
        self,
        count: int,
        block_ms: int,
        held: Collection[str] = (),
        max_batch: int | None = None,
        exclude_tenants: Collection[str] = (),
    ) -> list[Entry]:
        """As `JobReader.read`, taking `max_batch` batch jobs at most (default: `count`); 0
        leaves them queued (a worker full of batch jobs still takes interactive ones: its
        engine preempts the batch jobs). The jobs of `exclude_tenants` stay queued."""
        if count <= 0:
            return []
        if not self._own_pending_done:
            self._own_pending_done = True
            entries = await self._own_pending(held)
            if entries:
                return entries[:count]
        taken: list[Entry] = []
        if (claimed := await self.takeovers(count, held)) or (
            taken := await self._taken(count, max_batch, exclude_tenants)
        ):
            return claimed or taken
        block_ms = await self.lease_wait_ms(block_ms)
        await self.redis.blpop([f"{self._tag}:ready"], timeout=block_ms / 1000)
        return await self._taken(count, max_batch, exclude_tenants)

    async def _leased_streams(self) -> list[str]:
        return await self._queues()  # the tenant queues: their entries are the leased ones

    async def _own_pending(self, held: Collection[str]) -> list[Entry]:
        """After a restart: the entries this consumer was given and never finished."""
        entries = []
        for queue in await self._queues():
            reply = await self.redis.xreadgroup(self.group, self.consumer, {queue: "0"})
            for _, rows in reply or []:
                entries += await self._entries(queue, [row for row in rows if row[1]], held, delivered=True)
        return entries

    async def takeovers(self, count: int, held: Collection[str] = ()) -> list[Entry]:
        """Entries whose lease ran out (their worker died or hangs), from every queue."""
        if not self._taking_over():
            return []
        entries: list[Entry] = []
        for queue in await self._queues():
            try:
                _, claimed, _ = await self.redis.xautoclaim(
                    queue, self.group, self.consumer, self.claim_idle_ms, start_id="0-0", count=count
                )
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                continue
            entries += await self._entries(queue, [row for row in claimed if row[1]], held, delivered=True)
            if len(entries) >= count:
                break
        return entries

    async def _taken(
        self, count: int, max_batch: int | None = None, exclude_tenants: Collection[str] = ()
    ) -> list[Entry]:
        await self._await_admission()
        rows = await self._take(
            keys=[self.stream],
            args=[
                self.group,
                self.consumer,
                count,
                int(time.time() * 1000),
                self._priority_step_ms,
                self.fair.charge_prompt_weight,
                count if max_batch is None else max_batch,
                " ".join(exclude_tenants),  # tenant names never hold a space
            ],
        )
        entries = []
        for queue, entry_id, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2]))
            entries += await self._entries(text(queue), [(entry_id, fields)], (), delivered=False)
        return entries

    async def _await_admission(self) -> None:
        """Wait, up to `admission_wait_ms`, until the jobs that had arrived when the take
        began are admitted: the fair order then covers a whole burst, not the part of it
        admitted first. Arrivals after that do not prolong the wait."""
        wait_ms = self.fair.admission_wait_ms
        deadline = time.monotonic() + wait_ms / 1000
        mark = ""
        while time.monotonic() < deadline:
            mark = text(await self._admitting(keys=[self.stream], args=[wait_ms, mark]))
            if not mark:
                return
            await asyncio.sleep(ADMITTING_POLL_S)

    async def _entries(self, queue: str, rows: list, held: Collection[str], delivered: bool) -> list[Entry]:
        """Entries named by their origin, with the bookkeeping fields taken off."""
        entries = []
        for entry_id, fields in rows:
            fields = dict(fields)
            origin = text(fields.pop(ORIGIN_FIELD, b"") or entry_id)
            fields.pop(TOKENS_FIELD, None)
            fields.pop(AHEAD_FIELD, None)
            packed_ids = fields.pop(PROMPT_IDS_FIELD, None)
            if origin in held:
                continue
            queue_entry_id = text(entry_id)
            self._where[origin] = (queue, queue_entry_id)
            deliveries = 1
            if delivered:
                rows = await self.redis.xpending_range(
                    queue, self.group, min=queue_entry_id, max=queue_entry_id, count=1
                )
                deliveries = rows[0]["times_delivered"] if rows else 1
            prompt_ids = msgpack.unpackb(packed_ids) if packed_ids else None
            entries.append(Entry(origin, fields, deliveries, prompt_ids))
        return entries

    def took_batch(self, entry_id: str) -> bool:
        """Whether a job this reader gave out came from a batch queue."""
        queue = self._where.get(entry_id, ("",))[0]
        return queue.startswith(f"{self._tag}:q:{BATCH_LEVEL}:")

    async def _queues(self) -> list[str]:
        return sorted(text(queue) for queue in await self.redis.smembers(f"{self._tag}:queues"))

    async def renew(self, entry_ids: Collection[str]) -> list[str]:
        by_queue: dict[str, dict[str, str]] = defaultdict(dict)
        lost = []
        for origin in entry_ids:
            if origin in self._where:
                queue, queue_entry_id = self._where[origin]
                by_queue[queue][queue_entry_id] = origin
            else:
                lost.append(origin)
        for queue, origins in by_queue.items():
            try:
                gone = await self._renew(keys=[queue], args=[self.group, self.consumer, *origins])
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                continue
            lost += [origins[text(queue_entry_id)] for queue_entry_id in gone]
        for origin in lost:  # another worker has it now
            self._where.pop(origin, None)
        return lost

    async def ack(self, entry_id: str) -> None:
        if entry_id not in self._where:
            return  # lost to another worker meanwhile: it is theirs to ack
        queue, queue_entry_id = self._where.pop(entry_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(queue, self.group, queue_entry_id)
            pipe.xdel(queue, queue_entry_id)
            await pipe.execute()

    async def dead_letter(self, entry: Entry, code: str, message: str) -> None:
        """As `JobReader.dead_letter`, naming the request stream and the request entry."""
        record = dead_letter_record(entry, self.stream, self.consumer, code, message)
        await self.redis.xadd(self.dead_letter_stream, record, maxlen=self.dead_letter_max_len, approximate=True)
        await self.ack(entry.entry_id)
