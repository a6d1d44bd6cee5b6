"""The worker: jobs from the request stream into the engine, events out to reply streams.

The event loop (asyncio, uvloop in production) does the Redis I/O; the engine steps in
its own thread (`AsyncEngine`), so reads and publishes never wait for a forward pass.
It claims at most `capacity` jobs at a time (backpressure: idle workers get the rest),
publishes every event on the request's reply stream, and acks an entry once its final
event is published. An entry that cannot be served gets an `error` reply when its reply
stream can be named, and always a dead-letter record.

Failover: an entry delivered before (its worker died) continues from what its reply
stream already holds: the tokens there become part of the prompt, `max_tokens` shrinks
by their number, and `seq` goes on from the last one, so a reader sees every `seq` once.
A stop string split across the takeover point is not detected.

Cancellation: every worker follows the control stream; `XADD inflight:control * type
cancel id <request id>` ends that request (finish_reason `cancelled`) wherever it runs.

Observability: the engine's observer feeds `Metrics` after every step; the worker adds
each request's outcome and timings as it ends, and polls Redis for the ingest lag. Each
served request logs one summary line, with its id and priority bound as context.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import structlog
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, TimeoutError

from service.config import RedisConfig
from service.ingest import Entry, JobReader
from service.metrics import Metrics
from service.protocol import ProtocolError, decode_job
from service.publish import ReplyPublisher
from service.structured_logging import bind_request, log_request_finished
from workers.async_engine import AsyncEngine
from workers.engine import Engine
from workers.model_loader import encode_prompt
from workers.request import FinalEvent, FinishReason, InvalidRequest, Timings, Usage

log = structlog.get_logger("inflight.worker")


class Worker:
    def __init__(self, engine: Engine, redis, config: RedisConfig, metrics: Metrics | None = None,
                 ingest_poll_s: float = 5.0, log_prompts: bool = False) -> None:
        self.front = AsyncEngine(engine)
        self.config = config
        self.metrics = metrics or Metrics(engine.config.scheduler)
        engine.observer = self.metrics.observe_step
        self.ingest_poll_s = ingest_poll_s
        self.log_prompts = log_prompts  # prompts and outputs in the summary line: opt-in
        self.reader = JobReader(redis, config.requests_stream, config.group, config.consumer,
                                config.dead_letter_stream, config.claim_idle_ms, config.max_deliveries)
        self.publisher = ReplyPublisher(redis, config.reply_ttl_s, config.consumer)
        self.redis = redis
        # Enough queued work to keep the batcher full, no more.
        self.capacity = 2 * engine.config.scheduler.max_running_requests
        self.serving: dict[str, asyncio.Task] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; then finish what is in hand within the grace period
        and leave the rest pending, for another worker to continue."""
        await _retrying(self.reader.ensure_group)
        async with self.front:
            control = asyncio.create_task(self._follow_control(stop), name="control")
            lag = asyncio.create_task(self._poll_ingest_lag(stop), name="ingest-lag")
            while not stop.is_set():
                room = self.capacity - len(self.serving)
                if room <= 0:
                    await asyncio.wait(list(self.serving.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                entries = await _retrying(lambda: self.reader.read(room, self.config.block_ms))
                for entry in entries:
                    await self._start(entry)
            if self.serving:
                _, unfinished = await asyncio.wait(list(self.serving.values()), timeout=self.config.shutdown_grace_s)
                for task in unfinished:
                    task.cancel()  # no final event, no ack: the entry stays pending
                if unfinished:
                    await asyncio.wait(unfinished)
                while self.front.engine.has_unfinished():  # the engine drops what was cancelled
                    await asyncio.sleep(0.01)
            control.cancel()
            lag.cancel()

    async def _follow_control(self, stop: asyncio.Event) -> None:
        last = "$"  # only what is sent from now on
        while not stop.is_set():
            reply = await _retrying(lambda: self.redis.xread({self.config.control_stream: last},
                                                             block=self.config.block_ms))
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    request_id = fields.get(b"id", b"").decode(errors="replace")
                    if fields.get(b"type") == b"cancel" and request_id in self.serving:
                        self.front.cancel(request_id)

    async def _poll_ingest_lag(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.metrics.poll_ingest(self.redis, self.config.requests_stream, self.config.group,
                                               self.config.dead_letter_stream)
            except RedisError as error:  # the gauges keep their last values; the serving path logs outages
                log.debug("ingest_lag_poll_failed", error=str(error))
            await asyncio.sleep(self.ingest_poll_s)

    async def _start(self, entry: Entry) -> None:
        try:
            if entry.deliveries > self.config.max_deliveries:
                raise ProtocolError("too_many_deliveries", f"delivered {entry.deliveries} times")
            job = decode_job(entry.entry_id, entry.fields)
            if job.request_id in self.serving:
                raise ProtocolError("duplicate_id", f"request id {job.request_id!r} is already being served")
        except ProtocolError as error:
            self.metrics.observe_outcome("rejected")
            await self._reject(entry, error.code, error.message, error.reply_to, request_id=error.request_id)
            return
        task = asyncio.create_task(self._serve(entry, job), name=f"serve-{job.request_id}")
        self.serving[job.request_id] = task
        task.add_done_callback(lambda _: self.serving.pop(job.request_id, None))

    async def _serve(self, entry: Entry, job) -> None:
        bind_request(job.request_id, job.priority)  # this task's context only
        deadline = None if job.deadline_ms is None else job.deadline_ms / 1000
        prompt, params, seq, carried = job.prompt, job.params, 0, 0
        if entry.deliveries > 1:  # taken over: go on from what is already published
            published, finished = await _retrying(lambda: self.publisher.published(job.reply_to))
            if finished:
                await _retrying(lambda: self.reader.ack(entry.entry_id))
                return
            if published:
                seq = carried = len(published)
                if seq >= params.max_tokens:
                    await self._finish_length(entry, job, seq)
                    return
                tokenizer = self.front.engine.tokenizer
                base = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
                    encode_prompt(tokenizer, prompt)
                prompt = list(base) + published
                params = replace(params, max_tokens=params.max_tokens - seq)
        try:
            stream = self.front.submit(prompt, params, job.request_id, job.priority, deadline)
        except InvalidRequest as error:
            self.metrics.observe_outcome("rejected")
            await self._reject(entry, "duplicate_id", str(error), job.reply_to)
            return
        try:
            await self._publish(entry, job, stream, seq, carried)
        except asyncio.CancelledError:
            self.front.cancel(job.request_id)  # shutting down: free its place in the engine
            raise

    async def _publish(self, entry: Entry, job, stream, seq: int, carried: int) -> None:
        output: list[str] | None = [] if self.log_prompts else None
        async for event in stream:
            if isinstance(event, FinalEvent):
                self.metrics.observe_finished(event)
                if output is not None:
                    output.append(event.text)
                if output is None:
                    log_request_finished(log, event)
                else:
                    log_request_finished(log, event, prompt=job.prompt, output="".join(output))
                if event.error:
                    code = "internal_error" if event.error.startswith("model step failed") else "invalid_request"
                    await self._reject(entry, code, event.error, job.reply_to, seq)
                    return
                if carried:  # usage counts the whole request, not only this worker's part
                    usage = event.usage
                    event = replace(event, usage=Usage(usage.prompt_tokens - carried, usage.completion_tokens + carried))
                await self.publisher.done(job.reply_to, event, seq)
                await _retrying(lambda: self.reader.ack(entry.entry_id))
                return
            await self.publisher.token(job.reply_to, seq, event.text, event.token_ids)
            if output is not None:
                output.append(event.text)
            seq += 1

    async def _finish_length(self, entry: Entry, job, completion_tokens: int) -> None:
        """Every token was published before the takeover; only the final event is missing."""
        event = FinalEvent(job.request_id, FinishReason.LENGTH, Usage(0, completion_tokens), Timings(0.0, None, 0.0, ()))
        self.metrics.observe_outcome(FinishReason.LENGTH.value)  # no timings: they were the first worker's
        log.info("request_finished", finish_reason=FinishReason.LENGTH.value, completion_tokens=completion_tokens,
                 taken_over=True)
        await self.publisher.done(job.reply_to, event, completion_tokens)
        await _retrying(lambda: self.reader.ack(entry.entry_id))

    async def _reject(self, entry: Entry, code: str, message: str, reply_to: str | None, num_tokens: int = 0,
                      request_id: str | None = None) -> None:
        log.warning("job_dead_lettered", code=code, message=message, entry_id=entry.entry_id,
                    deliveries=entry.deliveries, **({"request_id": request_id} if request_id else {}))
        self.metrics.observe_dead_letter(code)
        if reply_to:
            await self.publisher.error(reply_to, code, message, num_tokens)
        await _retrying(lambda: self.reader.dead_letter(entry, code, message))


async def _retrying(call):
    """Run `call()` until Redis answers: a dropped connection or a restart is waited out
    with backoff, while the engine goes on generating."""
    delay = 0.05
    while True:
        try:
            result = await call()
        except AuthenticationError:
            raise  # wrong credentials do not get better with time
        except (ConnectionError, TimeoutError) as error:
            if delay == 0.05:  # once per outage, not once per retry
                log.warning("redis_unavailable", error=str(error) or type(error).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        if delay > 0.05:
            log.info("redis_recovered")
        return result

