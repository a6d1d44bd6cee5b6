"""Driving batches: every gateway runs a `BatchDriver`, which takes up each active batch
no other gateway holds (a lease in Redis, renewed while it drives; a gateway that dies
leaves it to expire, and another takes the batch over) and runs it (`BatchRun`).

A batch's lines go to the queue as batch jobs of its tenant, each through the very
translation an HTTP request to its endpoint gets (`openai_api.read_request`), at most
`batch_max_outstanding` at once, none while the gateway's backlog is over its limits,
and none before a refusal for load (`queue_full`, `quota_exceeded`) said to come back.
A job's id is `<batch>-<line>-<attempt>`, recorded before it is queued: a successor
follows the same reply stream, and queues the job again only when that stream does not
exist yet (the protocol runs an id once, so even that costs nothing but a dead letter).
Each result is recorded as it lands, the first for a line standing
(`batches.RECORD`), so a driver that died mid-way and its successor neither lose nor
repeat a line; reply streams expire within the hour, the results do not.

A cancel or the end of the window stops it: the jobs in flight are cancelled on the
control stream, those that finish within `reply_timeout_s` keep their answers, the rest
and every line never queued go to the error file (`batch_cancelled`, `batch_expired`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import structlog
from redis.exceptions import RedisError

from service.config import GatewayConfig
from service.gateway import batch_lines
from service.gateway.batch_lines import CANCELLED, ENDPOINTS, EXPIRED
from service.gateway.batches import CHUNK, TERMINAL, BatchStore, batch_object
from service.gateway.errors import APIError, bad_request, from_queue
from service.gateway.files import FileStore
from service.gateway.openai_api import Parsed, Renderer, choices_of, names_another_model, read_request, response_id
from service.gateway.queue import FINAL_TYPES, Queue, QueueUnavailable
from service.gateway.replies import ReplyTimeout
from service.protocol import reply_stream
from service.retry import FIRST_DELAY_S, stop_if_cancelled

log = structlog.get_logger("inflight.gateway")

LOAD_CODES = ("queue_full", "quota_exceeded")  # refused for load: queued again later
MAX_RETRY_DELAY_S = 5.0  # the longest wait between tries while Redis is away


class BatchDriver:
    """Takes up the active batches nobody drives, and drives them while its leases hold."""

    def __init__(self, config: GatewayConfig, queue: Queue, batches: BatchStore, files: FileStore) -> None:
        self.config, self.queue = config, queue
        self.batches, self.files = batches, files
        self.owner = uuid.uuid4().hex  # this gateway, as a lease holder
        self.driving: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        """Look for batches to take up every `batch_poll_s`, for as long as the gateway runs."""
        while True:
            stop_if_cancelled()  # redis-py can swallow a cancel (service/retry.py)
            try:
                for batch_id in await self.batches.active():
                    if batch_id not in self.driving and await self.batches.lease(
                        batch_id, self.owner, self.config.batch_lease_s
                    ):
                        self.driving[batch_id] = asyncio.create_task(self._drive(batch_id), name=batch_id)
            except RedisError as error:  # the batches wait; /health reports the outage
                log.debug("batch_lookup_failed", error=str(error))
            await asyncio.sleep(self.config.batch_poll_s)

    async def close(self, running: asyncio.Task) -> None:
        """Stop `running` (this driver's `run`) and every batch it drives, giving their
        leases back so another gateway takes them over at once."""
        running.cancel()
        for task in self.driving.values():
            task.cancel()
        await asyncio.gather(running, *self.driving.values(), return_exceptions=True)

    async def _drive(self, batch_id: str) -> None:
        """Run the batch while the lease is renewed; stop at once if it is lost."""
        lease_s = self.config.batch_lease_s
        run = asyncio.create_task(BatchRun(self, batch_id).run())
        try:
            while not run.done():
                await asyncio.wait([run], timeout=lease_s / 3)
                stop_if_cancelled()
                if not run.done() and not await self._renew(batch_id):
                    log.warning("batch_lease_lost", batch_id=batch_id)
                    break
            if run.done():
                run.result()
        except Exception:  # noqa: BLE001 - the lease goes back: this gateway or another tries again
            log.exception("batch_drive_failed", batch_id=batch_id)
        finally:
            run.cancel()
            await asyncio.wait([run])
            self.driving.pop(batch_id, None)
            try:
                await self.batches.release(batch_id, self.owner)
            except RedisError:
                pass  # it expires

    async def _renew(self, batch_id: str) -> bool:
        try:
            return await self.batches.renew(batch_id, self.owner, self.config.batch_lease_s)
        except RedisError:
            return True  # Redis away: go on; if the lease ran out meanwhile, the next renewal says so


class BatchRun:
    """One batch, from validation to its files, by the gateway holding its lease."""

    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self.config, self.queue = driver.config, driver.queue
        self.store, self.files = driver.batches, driver.files
        self.batch_id = batch_id
        self.tasks: dict[int, asyncio.Task] = {}  # line -> its job, queued and followed
        self.resume_at = 0.0  # time.monotonic() before which nothing is queued (a refusal for load)

    async def run(self) -> None:
        fields = await self.store.fields(self.batch_id)
        if fields is None or fields[b"status"].decode() in TERMINAL:
            await self.store.retire(self.batch_id)
            return
        self.object = batch_object(fields)
        self.tenant = fields[b"tenant"].decode()
        self.kind = ENDPOINTS[self.object["endpoint"]]
        self.deadline = float(fields[b"deadline"])
        if b"validated" not in fields:
            if fields[b"status"] == b"cancelling":  # cancelled before it ran: nothing to say
                await self._end_unstarted()
                return
            if not await self._validate():
                return
        try:
            await self._run_lines()
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # -- validating --------------------------------------------------------------------------

    async def _validate(self) -> bool:
        """Check the input file; False when the batch failed (or was cancelled) instead."""
        content = await self.files.content(None, self.object["input_file_id"])
        if content is None:
            gone = {"code": "file_not_found", "message": "the input file is gone", "param": None, "line": None}
            requests: list[str] = []
            errors: list[dict] = [gone]
        else:
            # Off the event loop: a large file takes a while to read.
            requests, errors = await asyncio.to_thread(batch_lines.check_input, content, self.object["endpoint"])
        if errors:
            moved, _ = await self.store.transition(
                self.batch_id, ("validating",), "failed", failed_at=now(), errors=json.dumps(errors)
            )
            if not moved:  # cancelled meanwhile
                await self._end_unstarted()
            else:
                await self._retire()
            return False
        await self.store.start(self.batch_id, requests)
        log.info("batch_started", batch_id=self.batch_id, tenant=self.tenant, requests=len(requests))
        return True

    # -- running -----------------------------------------------------------------------------

    async def _fields(self) -> dict[bytes, bytes]:
        """The batch's hash, which outlives its driver."""
        fields = await self.store.fields(self.batch_id)
        if fields is None:
            raise RuntimeError(f"batch {self.batch_id} is gone")
        return fields

    async def _run_lines(self) -> None:
        for line, attempt in (await self.store.in_flight(self.batch_id)).items():  # a predecessor's
            self._start(line, attempt)
        while True:
            stop_if_cancelled()
            fields = await self._fields()
            status = fields[b"status"].decode()
            counts = {name: int(fields[name.encode()]) for name in ("total", "completed", "failed")}
            all_recorded = counts["completed"] + counts["failed"] >= counts["total"]
            if status == "cancelling":
                await self._end(CANCELLED, "cancelled")
                return
            if status == "finalizing" or (all_recorded and await self._begin_finalizing()):
                await self._finalize("completed")
                return
            if status == "in_progress" and time.time() >= self.deadline:
                await self._end(EXPIRED, "expired")
                return
            while len(self.tasks) < self.config.batch_max_outstanding:
                claimed = await self.store.claim(self.batch_id)
                if claimed is None:
                    break
                self._start(claimed, 0)
            if self.tasks:
                await asyncio.wait(
                    list(self.tasks.values()), timeout=self.config.batch_poll_s, return_when=asyncio.FIRST_COMPLETED
                )
            else:
                await asyncio.sleep(self.config.batch_poll_s)

    async def _begin_finalizing(self) -> bool:
        """in_progress -> finalizing; False if it was cancelled meanwhile."""
        moved, _ = await self.store.transition(self.batch_id, ("in_progress",), "finalizing", finalizing_at=now())
        return moved

    def _start(self, line: int, attempt: int) -> None:
        task = asyncio.create_task(self._guarded(line, attempt))
        self.tasks[line] = task
        task.add_done_callback(lambda _: self.tasks.pop(line, None))

    async def _guarded(self, line: int, attempt: int) -> None:
        """`_run_line`, tried again from its latest attempt if this code fails, until the
        line is recorded (here or by another driver)."""
        while True:
            stop_if_cancelled()
            try:
                await self._run_line(line, attempt)
                return
            except Exception:  # noqa: BLE001 - a line must not hang in flight until its batch expires
                log.exception("batch_line_failed", batch_id=self.batch_id, line=line)
            await asyncio.sleep(MAX_RETRY_DELAY_S)
            attempt = (await _retried(self.store.in_flight, self.batch_id)).get(line)
            if attempt is None:
                return

    async def _run_line(self, line: int, attempt: int) -> None:
        """Queue the line's job (again after a refusal for load) and record its answer;
        a failure of Redis or of this code is waited out and tried again."""
        request = await _retried(self.store.request, self.batch_id, line)
        try:
            parsed = await self._read(request)
        except APIError as error:  # refused as its HTTP request would be: nothing queued
            await self._record(
                {line: "e" + batch_lines.refused(self.batch_id, line, request["custom_id"], None, error)}
            )
            return
        delay = FIRST_DELAY_S
        while True:
            stop_if_cancelled()
            job_id = f"{self.batch_id}-{line}-{attempt}"
            try:
                payload = parsed.payload(job_id, self.tenant, batch=True)
            except APIError as error:  # e.g. over the entry size
                await self._record(
                    {line: "e" + batch_lines.refused(self.batch_id, line, request["custom_id"], None, error)}
                )
                return
            try:
                await self._queue(job_id, payload)
                final, tokens = await self._follow(job_id, max(1.0, self.deadline - time.time() + 1))
            except (RedisError, QueueUnavailable, OSError) as error:
                log.debug("batch_job_retried", request_id=job_id, error=str(error))
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY_S)
                continue
            if final is None:
                return  # silent until the window ended: the batch expires
            if final["type"] == "error" and final["code"] in LOAD_CODES:
                wait_s = float(final.get("retry_after_s") or self.config.retry_after_s)
                self.resume_at = max(self.resume_at, time.monotonic() + wait_s)
                attempt += 1
                await _retried(self.store.retry, self.batch_id, line, attempt)
                continue
            await self._record({line: self._result(line, request["custom_id"], parsed, job_id, final, tokens)})
            return

    async def _read(self, request: dict) -> Parsed:
        body = request["body"]
        # A line naming an adapter: the registry, waited for while Redis is away.
        adapters = await _retried(self.queue.adapters) if names_another_model(body, self.config) else {}
        parsed = read_request(self.kind, body, self.config, adapters)
        if parsed.stream:
            raise bad_request("stream is not supported in a batch", "stream")
        return parsed

    async def _queue(self, job_id: str, payload: bytes) -> None:
        """Queue the job, unless it was queued before (its reply stream exists); first
        wait out a refusal for load and a backlog over the gateway's limits."""
        while (wait_s := self.resume_at - time.monotonic()) > 0 or self.queue.overloaded():
            stop_if_cancelled()
            await asyncio.sleep(max(wait_s, self.config.queue_poll_s))
        if not await self.queue.redis.exists(reply_stream(job_id)):
            await self.queue.submit(payload)

    async def _follow(self, job_id: str, timeout_s: float) -> tuple[dict | None, list[dict]]:
        """The job's final event (None if it stays silent for `timeout_s`) and its tokens."""
        tokens: list[dict] = []
        replies = self.queue.replies(job_id, timeout_s)
        try:
            async for events in replies:
                if events[-1]["type"] in FINAL_TYPES:
                    return events[-1], tokens + events[:-1]
                tokens.extend(events)
        except ReplyTimeout:
            pass
        finally:
            await replies.aclose()
        return None, tokens

    def _result(self, line: int, custom_id: str, parsed: Parsed, job_id: str, final: dict, tokens: list) -> str:
        """A finished job as the record of its output line (`o`) or error line (`e`)."""
        if final["type"] == "done":
            body = Renderer(parsed, response_id(parsed.kind, job_id)).whole(tokens, final)
            return "o" + batch_lines.answered(self.batch_id, line, custom_id, job_id, body)
        error = from_queue(final["code"], final["message"], final.get("retry_after_s"))
        return "e" + batch_lines.refused(self.batch_id, line, custom_id, job_id, error)

    async def _record(self, results: dict[int, str]) -> None:
        await _retried(self.store.record, self.batch_id, results)

    # -- ending ------------------------------------------------------------------------------

    async def _end(self, code: str, status: str) -> None:
        """Cancelled or expired: queue nothing more, cancel the jobs in flight, keep the
        answers of those that finish anyway, and fail the rest with `code`."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        first_unqueued = await self.store.claim_rest(self.batch_id)
        in_flight = await self.store.in_flight(self.batch_id)
        for line, attempt in in_flight.items():
            await self.queue.cancel(f"{self.batch_id}-{line}-{attempt}")
        await asyncio.gather(*(self._settle(line, attempt, code) for line, attempt in in_flight.items()))
        total = int((await self._fields())[b"total"])
        for first in range(first_unqueued, total, CHUNK):
            requests = await self.store.requests(self.batch_id, first, min(first + CHUNK, total) - 1)
            await self._record(
                {
                    first + i: "e" + batch_lines.ended(self.batch_id, first + i, request["custom_id"], code)
                    for i, request in enumerate(requests)
                }
            )
        await self._finalize(status)

    async def _settle(self, line: int, attempt: int, code: str) -> None:
        """A job in flight as its batch ends: its answer if it finishes (not cancelled)
        within `reply_timeout_s`, else `code`."""
        request = await self.store.request(self.batch_id, line)
        job_id = f"{self.batch_id}-{line}-{attempt}"
        final, tokens = await self._follow(job_id, self.config.reply_timeout_s)
        cancelled = (
            final is not None
            and final["type"] == "done"
            and any(c["finish_reason"] == "cancelled" for c in choices_of(final))
        )
        if final is None or cancelled or (final["type"] == "error" and final["code"] in LOAD_CODES):
            record = "e" + batch_lines.ended(self.batch_id, line, request["custom_id"], code)
        else:
            record = self._result(line, request["custom_id"], await self._read(request), job_id, final, tokens)
        await self._record({line: record})

    async def _finalize(self, status: str) -> None:
        """Write the output and error files (in input order), then end the batch. Done
        again from the start by a successor, over the same file ids."""
        results = await self.store.results(self.batch_id)
        lines: dict[str, list[str]] = {"o": [], "e": []}
        for line in sorted(results):
            record = results[line].decode()
            lines[record[0]].append(record[1:])
        hex_id = self.batch_id.removeprefix("batch_")
        file_ids = {}
        for kind, name in (("o", "output"), ("e", "error")):
            if lines[kind]:
                content = ("\n".join(lines[kind]) + "\n").encode()
                file_id = f"file-{hex_id}-{name}"
                await self.files.put(self.tenant, f"{self.batch_id}_{name}.jsonl", "batch_output", content, file_id)
                file_ids[f"{name}_file_id"] = file_id
        await self.store.transition(
            self.batch_id,
            ("in_progress", "finalizing", "cancelling"),
            status,
            **{f"{status}_at": now()},
            **file_ids,
        )
        await self._retire()
        counts = {"completed": len(lines["o"]), "failed": len(lines["e"])}
        log.info("batch_finished", batch_id=self.batch_id, tenant=self.tenant, status=status, **counts)

    async def _end_unstarted(self) -> None:
        """Cancelled before its requests were in place: it ends with none run."""
        await self.store.transition(self.batch_id, ("cancelling",), "cancelled", cancelled_at=now())
        await self._retire()

    async def _retire(self) -> None:
        await self.store.retire(self.batch_id)


def now() -> int:
    """A batch's timestamps: unix seconds, as OpenAI's."""
    return int(time.time())


async def _retried(call, *args):
    """`call(*args)`, tried again while Redis is away (a batch waits; it is not failed)."""
    delay = FIRST_DELAY_S
    while True:
        stop_if_cancelled()
        try:
            return await call(*args)
        except (RedisError, OSError) as error:
            log.debug("batch_redis_retried", error=str(error))
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
