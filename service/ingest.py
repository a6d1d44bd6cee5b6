"""Reads jobs from the request stream through a consumer group (docs/protocol.md).

Queue semantics:
- a worker reads under a stable consumer name; on start it first re-reads its own
  pending entries (delivered to it before a restart, never acked), then new ones;
- every entry a worker holds is on a lease: `renew` resets its idle time (XCLAIM
  JUSTID, only where this consumer still owns it) every `claim_idle_ms / 4`, so an entry
  waiting in a long backlog is never mistaken for a dead worker's;
- entries idle longer than `claim_idle_ms` (their worker stopped renewing: it died or
  hangs) are taken over with XAUTOCLAIM; ids the caller already holds are skipped. A
  worker's blocking wait ends when the next lease held by another consumer runs out, so
  a takeover starts then rather than up to a block later (`lease_wait_ms`). After
  Redis was unreachable, a worker takes nothing over for one lease period: every live
  worker was cut off too, and gets that long to renew its own;
- a worker process whose connections are all gone has died: the kernel closed its
  sockets. `inflight worker` names its connections after its consumer (`client_name`).
  When another worker has missed a renewal, a waiting worker looks at the connections
  (CLIENT LIST; otherwise once a lease period, to learn who is connected), and takes
  over at once (XCLAIM) the entries of a worker it saw connected before and sees no
  more, without waiting for their leases. A worker that hangs (stopped, or cut off
  from Redis) keeps its connections and is taken over on its leases; one never seen
  connected too. Where CLIENT LIST is refused (an ACL, a managed service) or on a Redis
  Cluster, leases alone decide;
- the caller asks for at most as many entries as it can take (backpressure), so idle
  workers get the rest;
- an entry is acked and deleted in one transaction once its final event is published
  (Redis keeps no finished prompt); an entry that cannot be served goes to the capped
  dead-letter stream with its error, and is then acked and deleted. Those are two steps:
  on a Redis Cluster the two streams may live on different shards, where no transaction
  spans them. The dead letter is written first, so a crash between the steps leaves the
  entry pending, to be dead-lettered again: at worst a duplicate dead letter, never a
  lost one.

Every command names one key (or keys of one hash slot), so it all works the same on a
Redis Cluster, where the request stream is one key on one shard.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from service.config import RedisConfig
from service.lua_scripts import lua
from service.text import text

log = structlog.get_logger("inflight.ingest")

# Resets the idle time of the entries this consumer still owns; returns the ids it no
# longer owns (taken over by another worker, or deleted). One round trip for them all.
RENEW = lua("ingest_renew")


# Pending entries looked at for the next lease to run out: all of them at any real
# deployment's size (a worker holds at most its capacity and allowance).
PENDING_SCAN = 1000
# The shortest wait it makes: an entry whose lease ran out but that cannot be taken yet
# (too many at once, or during an outage's hold-off) must not turn the wait into a spin.
MIN_LEASE_WAIT_MS = 50
# An entry idle this much longer than the renewal interval (`claim_idle_ms / 4`) has
# missed a renewal: its worker may have died.
RENEWAL_SLACK_MS = 100
# While other workers hold entries, a waiting worker looks at least this often for one
# that died.
DEAD_LOOK_MS = 250
CLIENT_NAME_PREFIX = "inflight-worker:"


def client_name(consumer: str) -> str:
    """The connection name of a worker with this consumer name (CLIENT SETNAME takes no
    spaces or control characters: those become '_')."""
    return CLIENT_NAME_PREFIX + "".join(c if "!" <= c <= "~" else "_" for c in consumer)


async def lease_wait_ms(
    redis, streams, group: str, consumer: str, claim_idle_ms: int, block_ms: int, look_ms: int | None = None
) -> int:
    """`block_ms`, or less where an entry of `streams` pending with another consumer
    reaches `claim_idle_ms` idle sooner: then just past that moment; at most `look_ms`
    while another consumer holds entries."""
    idlest = -1
    for stream in streams:
        try:
            rows = await redis.xpending_range(stream, group, min="-", max="+", count=PENDING_SCAN)
        except ResponseError:  # no group yet
            continue
        for row in rows:
            if text(row["consumer"]) != consumer:
                idlest = max(idlest, row["time_since_delivered"])
    if idlest < 0:
        return block_ms
    return max(MIN_LEASE_WAIT_MS, min(block_ms, claim_idle_ms - idlest + 1, look_ms or block_ms))


@dataclass(frozen=True)
class Entry:
    entry_id: str
    fields: dict  # bytes -> bytes, as Redis returns them
    deliveries: int  # how many times it has been delivered, this delivery included
    # The prompt's token ids when the fair queue's admission tokenized it already
    # (service/fair_queue/keys.py, PROMPT_IDS_FIELD); None: the engine tokenizes it.
    prompt_ids: list[int] | None = None


class LeasedReader:
    """What a worker's readers share: the request stream and its consumer group, this
    worker's consumer name, the lease, and takeovers held back after an outage."""

    def __init__(self, redis, config: RedisConfig) -> None:
        self.redis = redis  # a redis.asyncio Redis or RedisCluster whose socket timeout exceeds any BLOCK
        self.stream = config.requests_stream
        self.group = config.group
        self.consumer = config.consumer
        self.dead_letter_stream = config.dead_letter_stream
        self.dead_letter_max_len = config.dead_letter_max_len
        self.claim_idle_ms = config.claim_idle_ms
        self._renew = redis.register_script(RENEW)
        self._own_pending_done = False
        self._takeovers_from = 0.0  # monotonic time; later after an outage
        # Whether CLIENT LIST tells live workers from dead ones here (see the module doc).
        self._liveness = not isinstance(redis, RedisCluster)
        self._seen_connected: set[str] = set()  # other consumers holding entries, seen with a connection
        self._connections_seen_at = -float("inf")  # monotonic time of the last CLIENT LIST

    def outage_seen(self) -> None:
        """Redis was unreachable: hold takeovers back for one lease period."""
        self._takeovers_from = time.monotonic() + self.claim_idle_ms / 1000

    def _taking_over(self) -> bool:
        return time.monotonic() >= self._takeovers_from

    async def lease_wait_ms(self, block_ms: int) -> int:
        """How long to wait for new work before looking for takeovers again (`lease_wait_ms`)."""
        if not self._taking_over():
            return block_ms
        streams = await self._leased_streams()
        look_ms = DEAD_LOOK_MS if self._liveness else None
        return await lease_wait_ms(
            self.redis, streams, self.group, self.consumer, self.claim_idle_ms, block_ms, look_ms
        )

    async def _leased_streams(self) -> list[str]:
        """The streams whose entries are leased."""
        return [self.stream]

    async def dead_consumers(self, holding: Collection[str], overdue: Collection[str]) -> list[str]:
        """Those of `overdue` (other consumers that missed a renewal) whose process died:
        seen connected before, with no connection now. `holding`: every other consumer
        with pending entries, whose connections are looked at while any is overdue, and
        otherwise once a lease period."""
        now = time.monotonic()
        looking = overdue or now - self._connections_seen_at >= self.claim_idle_ms / 1000
        if not (self._liveness and holding and looking):
            return []
        try:
            names = {text(client.get("name") or "") for client in await self.redis.client_list()}
        except ResponseError as error:  # CLIENT LIST refused: leases alone decide
            log.warning("worker_liveness_unavailable", error=str(error))
            self._liveness = False
            return []
        self._connections_seen_at = now
        connected = {consumer for consumer in holding if client_name(consumer) in names}
        dead = [consumer for consumer in overdue if consumer in self._seen_connected and consumer not in connected]
        # Those gone and holding nothing any more (taken over, or restarted under another name) are forgotten.
        self._seen_connected = (self._seen_connected & set(holding)) | connected
        return dead


class JobReader(LeasedReader):
    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def read(self, count: int, block_ms: int, held: Collection[str] = ()) -> list[Entry]:
        """Up to `count` entries not in `held`: this consumer's own pending ones first
        (once, after a restart), then entries whose lease ran out, then new ones (waiting
        up to `block_ms` for them)."""
        try:
            return await self._read(count, block_ms, held)
        except (ConnectionError, TimeoutError):
            self.outage_seen()
            raise

    async def _read(self, count: int, block_ms: int, held: Collection[str]) -> list[Entry]:
        if count <= 0:
            return []
        if not self._own_pending_done:
            entries = await self._read_group("0", count + len(held), block_ms=None)
            entries = [(entry_id, fields) for entry_id, fields in entries if text(entry_id) not in held]
            if len(entries) < count:
                self._own_pending_done = True  # everything it had is in hand
            if entries:
                return await self._with_deliveries(entries[:count])
        if claimed := await self.takeovers(count, held):
            return claimed
        block_ms = await self.lease_wait_ms(block_ms)
        # A new entry is on its first delivery: no need to ask Redis.
        return [Entry(text(entry_id), fields, 1) for entry_id, fields in await self._read_group(">", count, block_ms)]

    async def takeovers(self, count: int, held: Collection[str] = ()) -> list[Entry]:
        """Up to `count` entries whose lease ran out (their worker died or hangs), not in `held`."""
        if not self._taking_over():
            return []
        try:
            _, claimed, _ = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, start_id="0-0", count=count
            )
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            return []
        # Deleted entries come back empty; an id in hand only missed a renewal.
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields and text(entry_id) not in held]
        if len(claimed) < count and self._liveness:
            claimed += await self._from_dead_workers(count - len(claimed), held)
        return await self._with_deliveries(claimed) if claimed else []

    async def _from_dead_workers(self, count: int, held: Collection[str]) -> list[tuple[str, dict]]:
        """Up to `count` entries of workers that died (`dead_consumers`), before their
        leases run out."""
        rows = await self.redis.xpending_range(self.stream, self.group, min="-", max="+", count=PENDING_SCAN)
        missed_ms = self.claim_idle_ms / 4 + RENEWAL_SLACK_MS
        others = [row for row in rows if text(row["consumer"]) != self.consumer]
        overdue = {text(row["consumer"]) for row in others if row["time_since_delivered"] > missed_ms}
        dead = await self.dead_consumers({text(row["consumer"]) for row in others}, overdue)
        ids = [
            row["message_id"] for row in others if text(row["consumer"]) in dead and text(row["message_id"]) not in held
        ][:count]
        if not ids:
            return []
        # Only entries still not renewed: a worker that came back keeps its own.
        claimed = await self.redis.xclaim(self.stream, self.group, self.consumer, int(missed_ms), ids)
        log.info("dead_worker_taken_over", consumers=dead, entries=len(claimed))
        return [(entry_id, fields) for entry_id, fields in claimed if fields]

    async def renew(self, entry_ids: Collection[str]) -> list[str]:
        """Keep the leases of `entry_ids`; returns those this consumer no longer owns."""
        if not entry_ids:
            return []
        try:
            lost = await self._renew(keys=[self.stream], args=[self.group, self.consumer, *entry_ids])
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self.ensure_group()  # a Redis restarted without persistence lost it: keep serving
            return []
        return [text(entry_id) for entry_id in lost]

    async def ack(self, entry_id: str) -> None:
        """Done with the entry: ack it and delete it, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, entry_id)
            pipe.xdel(self.stream, entry_id)
            await pipe.execute()

    async def dead_letter(self, entry: Entry, code: str, message: str) -> None:
        """Park the entry, with why, on the dead-letter stream; then ack and delete it here
        (two steps: see the module docstring)."""
        record = dead_letter_record(entry, self.stream, self.consumer, code, message)
        await self.redis.xadd(self.dead_letter_stream, record, maxlen=self.dead_letter_max_len, approximate=True)
        await self.ack(entry.entry_id)

    async def _read_group(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, dict]]:
        try:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: start}, count=count, block=block_ms
            )
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self.ensure_group()  # a Redis restarted without persistence lost it
            return []
        return [(entry_id, fields) for _, entries in reply or [] for entry_id, fields in entries if fields]

    async def _with_deliveries(self, entries: list[tuple]) -> list[Entry]:
        ids = [text(entry_id) for entry_id, _ in entries]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:  # one round trip for all of them
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            pending = await pipe.execute()
        deliveries = [rows[0]["times_delivered"] if rows else 1 for rows in pending]
        return [Entry(entry_id, fields, n) for entry_id, (_, fields), n in zip(ids, entries, deliveries)]


def dead_letter_record(entry: Entry, stream: str, consumer: str, code: str, message: str) -> dict:
    """A dead letter: which entry of which stream, why, and its fields as they came."""
    record = {
        "entry_id": entry.entry_id,
        "stream": stream,
        "code": code,
        "message": message,
        "deliveries": str(entry.deliveries),
        "consumer": consumer,
    }
    record.update({f"field:{text(k, errors='replace')}": v for k, v in entry.fields.items()})
    return record
