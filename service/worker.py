"""The worker: jobs from the request stream into the engine, events out to reply streams.

The event loop (asyncio, uvloop in production) does the Redis I/O; the engine steps in
its own thread (`AsyncEngine`), so reads and publishes never wait for a forward pass.
It claims at most `capacity` jobs at a time (backpressure: idle workers get the rest),
publishes every event on the request's reply stream, and acks an entry once its final
event is published. An entry that cannot be served gets an `error` reply when its reply
stream can be named, and always a dead-letter record.
"""

from __future__ import annotations

import asyncio

from service.config import RedisConfig
from service.ingest import Entry, JobReader
from service.protocol import ProtocolError, decode_job
from service.publish import ReplyPublisher
from workers.async_engine import AsyncEngine
from workers.engine import Engine
from workers.request import FinalEvent, InvalidRequest


class Worker:
    def __init__(self, engine: Engine, redis, config: RedisConfig) -> None:
        self.front = AsyncEngine(engine)
        self.config = config
        self.reader = JobReader(redis, config.requests_stream, config.group, config.consumer,
                                config.dead_letter_stream, config.claim_idle_ms, config.max_deliveries)
        self.publisher = ReplyPublisher(redis, config.reply_ttl_s)
        # Enough queued work to keep the batcher full, no more.
        self.capacity = 2 * engine.config.scheduler.max_running_requests
        self.serving: dict[str, asyncio.Task] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then finish what is in hand."""
        await self.reader.ensure_group()
        async with self.front:
            while not stop.is_set():
                room = self.capacity - len(self.serving)
                if room <= 0:
                    await asyncio.wait(list(self.serving.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                for entry in await self.reader.read(room, self.config.block_ms):
                    await self._start(entry)
            if self.serving:
                await asyncio.wait(list(self.serving.values()))

    async def _start(self, entry: Entry) -> None:
        try:
            if entry.deliveries > self.config.max_deliveries:
                raise ProtocolError("too_many_deliveries", f"delivered {entry.deliveries} times")
            job = decode_job(entry.entry_id, entry.fields)
            if job.request_id in self.serving:
                raise ProtocolError("duplicate_id", f"request id {job.request_id!r} is already being served")
        except ProtocolError as error:
            await self._reject(entry, error.code, error.message, error.reply_to)
            return
        task = asyncio.create_task(self._serve(entry, job), name=f"serve-{job.request_id}")
        self.serving[job.request_id] = task
        task.add_done_callback(lambda _: self.serving.pop(job.request_id, None))

    async def _serve(self, entry: Entry, job) -> None:
        deadline = None if job.deadline_ms is None else job.deadline_ms / 1000
        try:
            stream = self.front.submit(job.prompt, job.params, job.request_id, job.priority, deadline)
        except InvalidRequest as error:
            await self._reject(entry, "duplicate_id", str(error), job.reply_to)
            return
        seq = 0
        async for event in stream:
            if isinstance(event, FinalEvent):
                if event.error:
                    code = "internal_error" if event.error.startswith("model step failed") else "invalid_request"
                    await self._reject(entry, code, event.error, job.reply_to)
                    return
                await self.publisher.done(job.reply_to, event)
                await self.reader.ack(entry.entry_id)
                return
            await self.publisher.token(job.reply_to, seq, event.text, event.token_ids)
            seq += 1

    async def _reject(self, entry: Entry, code: str, message: str, reply_to: str | None) -> None:
        if reply_to:
            await self.publisher.error(reply_to, code, message)
        await self.reader.dead_letter(entry, code, message)

