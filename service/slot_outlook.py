"""When each of a worker's running slots is predicted to free, published in Redis for the
fair queue's admission (`--max-queue-wait-s`; docs/protocol.md, "Tenants, batch jobs and
admission").

A job with nothing queued ahead of it still waits for a slot to free, and how long depends
on the jobs running: a fleet whose jobs all started a second ago frees nothing for a while.
So every worker publishes, several times a second, one time per slot: now for a free slot
(or one held by a batch job, which an interactive job preempts), else when its job is
predicted to end at the latest, its max_tokens at the pace it has been producing tokens.
An upper bound: a job that stops early frees its slot sooner, for the next arrival. A job
with no pace of its own yet (its prompt still computing) takes the pace of the worker's
other jobs, or of its last finished one. A worker publishes again at once when a job
starts or ends, so a freed slot is seen free within milliseconds, not a tick later.
Admission reads every worker's times and judges a new job by the slot it would get.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from service.lua_scripts import lua

log = structlog.get_logger("inflight.slot_outlook")

PUBLISH_INTERVAL_S = 0.1
# At most this often when jobs start and end in quick succession (a GPU's rates).
MIN_PUBLISH_GAP_S = 0.005
# A worker that stopped publishing (dead, or its event loop stalled) drops out after this.
OUTLOOK_TTL_MS = 2000
# A slot whose job has no pace yet, on a worker that has measured none: not soon.
UNKNOWN_END_S = 3600.0

# The slots' ends, on Redis's clock (service/lua/slot_outlook_publish.lua).
PUBLISH = lua("slot_outlook_publish")


@dataclass
class _Progress:
    max_tokens: int  # every choice's
    batch: bool
    produced: int = 0
    first_at: float | None = None  # when its first tokens came
    first_count: int = 0  # and how many
    last_at: float | None = None  # when its latest tokens came

    def seconds_per_token(self, now: float) -> float | None:
        if self.first_at is None or self.produced <= self.first_count:
            return None
        return (now - self.first_at) / (self.produced - self.first_count)


class SlotOutlook:
    """One worker's slots and when they free; `run` publishes them."""

    def __init__(self, redis, stream: str, consumer: str, slots: int) -> None:
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self.slots = slots
        self._publish = redis.register_script(PUBLISH)
        self._jobs: dict[str, _Progress] = {}
        self._last_pace: float | None = None  # seconds a token, of the last job that had one
        self._changed = asyncio.Event()  # a job started or ended: publish now

    def started(self, key: str, max_tokens: int, batch: bool) -> None:
        self._jobs[key] = _Progress(max_tokens, batch)
        self._changed.set()

    def produced(self, key: str, num_tokens: int, now: float) -> None:
        progress = self._jobs.get(key)
        if progress is None:
            return
        if progress.first_at is None:
            progress.first_at, progress.first_count = now, num_tokens
        progress.produced += num_tokens
        progress.last_at = now

    def ended(self, key: str) -> None:
        job = self._jobs.pop(key, None)
        if job is not None and job.last_at is not None:
            self._last_pace = job.seconds_per_token(job.last_at) or self._last_pace
        self._changed.set()

    def ends_s(self, held: Collection[str], now: float) -> list[float]:
        """Seconds until each slot frees: one per held job (a job not started yet: not
        soon), and now for each slot left."""
        paces = [p for p in (job.seconds_per_token(now) for job in self._jobs.values()) if p is not None]
        mean_pace = sum(paces) / len(paces) if paces else self._last_pace
        ends = []
        for key in held:
            job = self._jobs.get(key)
            if job is None:
                ends.append(UNKNOWN_END_S)
            elif job.batch:
                ends.append(0.0)
            elif job.produced >= job.max_tokens:
                ends.append(0.0)  # all made (a burst of accepted drafts may have brought them at once)
            else:
                pace = job.seconds_per_token(now) or mean_pace
                ends.append(UNKNOWN_END_S if pace is None else (job.max_tokens - job.produced) * pace)
        return ends + [0.0] * max(0, self.slots - len(held))

    async def publish(self, held: Collection[str]) -> None:
        offsets_ms = [int(end * 1000) for end in self.ends_s(held, time.monotonic())]
        await self._publish(keys=[self.stream], args=[self.consumer, OUTLOOK_TTL_MS, *offsets_ms])

    async def run(self, held: Collection[str], stop: asyncio.Event) -> None:
        """Publish until `stop` is set (a worker winding down takes no more jobs), then
        withdraw."""
        while not stop.is_set():
            self._changed.clear()
            try:
                await self.publish(held)
            except RedisError as error:  # Redis away: the outlook expires, admission falls back
                log.debug("outlook_failed", error=str(error))
            await asyncio.sleep(MIN_PUBLISH_GAP_S)
            # Until a slot changes, the interval passes, or the worker winds down.
            waits = [asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(stop.wait())]
            _, pending = await asyncio.wait(waits, timeout=PUBLISH_INTERVAL_S, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
        try:
            await self.redis.delete("{" + self.stream + "}:outlook:" + self.consumer)
        except RedisError:
            pass
