"""The reply outbox: every engine step's events go to Redis in one pipelined round trip.

The engine hands over all the events of a step at once (`on_events`, on the event
loop). They wait here per reply stream, and one flushing task writes everything that is
waiting with `ReplyPublisher.append`: one pipeline, one fenced script call per stream,
in order within each stream. While a pipeline is in flight, the next steps' events
gather, so when Redis is slower than the engine each round trip carries more events
and the engine never waits. What waits is bounded by what the engine produces for the
requests the worker holds: each token is one entry, never coalesced, so `seq` counts
tokens exactly as docs/protocol.md says.

A job opens its stream here before it is submitted and gets a future that resolves,
once everything before it has landed, to its `FinalEvent` and the number of tokens
published. A done event is written with the tokens; an error final is not (the job
writes it with its dead letter), nor is a `handoff` (the job goes on elsewhere). The
future fails with `LeaseLost` when another worker owns the stream now, and with the
`RedisError` Redis answered for that stream alone.

TTLs: a write refreshes its stream's TTL at the first write, the final event, and
otherwise at most once every `ttl_s / TTL_REFRESHES` seconds.

Repair: a stream keeps the events it has landed while its job runs. Redis replicates
asynchronously, so a failover can lose the last events the old primary took; each write
checks that the stream still holds every event written before it (`Gap`), and if not,
what was lost is sent again, in order, before anything new, with the same entry ids, so
a reader sees each `seq` once. What a worker did not write itself (before a takeover)
it cannot send again: that gap stays, and is logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from service.protocol import done_fields, token_data
from service.publish import Append, Gap, LeaseLost, ReplyPublisher
from service.retry import retrying
from workers.api import Event, FinalEvent, FinishReason

log = structlog.get_logger("inflight.outbox")

# A stream being written has its TTL renewed this many times per TTL, at least.
TTL_REFRESHES = 10


@dataclass(frozen=True)
class Published:
    """How a job's stream ended: its final event, after `num_tokens` token events."""

    final: FinalEvent
    num_tokens: int
    text: str | None  # everything it generated, when the job asked to keep it (for logs)


@dataclass
class _Stream:
    reply_to: str
    entry_id: str
    seq: int  # the next token's seq
    result: asyncio.Future
    first_seq: int = 0  # the first token event this worker writes (after a takeover, not 0)
    landed: list[bytes] = field(default_factory=list)  # its token events landed so far, from first_seq
    gap_at: int | None = None  # a gap before first_seq, lost in a failover: the next write accepts it
    waiting: list[bytes] = field(default_factory=list)  # token events not yet sent, as msgpack
    oldest: float = 0.0  # when the oldest waiting event's step ended (monotonic)
    final: FinalEvent | None = None
    final_waiting: tuple[str, dict] | None = None  # a done event not yet sent: (entry id, fields)
    refreshed_at: float | None = None  # last TTL refresh (monotonic); None: never written
    text: list[str] | None = None
    indexed: bool = False  # n > 1: each token event names its choice


class ReplyOutbox:
    def __init__(self, publisher: ReplyPublisher, observe_lag: Callable[[float], None] = lambda seconds: None) -> None:
        self.publisher = publisher
        self.observe_lag = observe_lag  # seconds from a step's end to its events landing
        self._streams: dict[str, _Stream] = {}  # by request id (the entry id)
        self._ready = asyncio.Event()
        self._refresh_s = publisher.ttl_s / TTL_REFRESHES

    def open(
        self, request_id: str, reply_to: str, entry_id: str, seq: int, keep_text: bool = False, choices: int = 1
    ) -> asyncio.Future[Published]:
        """Route `request_id`'s events to `reply_to`, from token `seq` on; with `choices`
        > 1 each token event names its choice."""
        stream = _Stream(
            reply_to,
            entry_id,
            seq,
            asyncio.get_running_loop().create_future(),
            first_seq=seq,
            text=[] if keep_text else None,
            indexed=choices > 1,
        )
        self._streams[request_id] = stream
        return stream.result

    def close(self, request_id: str) -> None:
        """Forget a job (it ended, or was cancelled): what it had waiting is dropped."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.result.done():
            stream.result.cancel()

    def on_events(self, events: list[Event]) -> None:
        """One step's events; events of requests not opened here are ignored."""
        now = time.monotonic()
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None or stream.final is not None:
                continue
            if not stream.waiting and stream.final_waiting is None:
                stream.oldest = now
            if isinstance(event, FinalEvent):
                stream.final = event
                if event.error_code is None and event.finish_reason is not FinishReason.HANDOFF:
                    stream.final_waiting = (f"{stream.seq}-1", done_fields(event, self.publisher.worker))
            else:
                stream.waiting.append(
                    token_data(
                        stream.seq,
                        event.text,
                        event.token_ids,
                        event.index if stream.indexed else None,
                        event.logprob,
                        event.token,
                        event.top_logprobs,
                    )
                )
                stream.seq += 1
            if stream.text is not None:
                stream.text.append(event.text)
        self._ready.set()

    async def run(self) -> None:
        """Flush whatever is waiting, one round trip at a time, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            try:
                await self._flush()
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception:  # never leave the jobs waiting on a dead flusher
                log.exception("outbox_flush_failed")
                for stream in list(self._streams.values()):
                    self._fail(stream, RuntimeError("the reply outbox failed"))

    async def _flush(self) -> None:
        now = time.monotonic()
        batch, appends = [], []
        for stream in self._streams.values():
            if stream.result.done() or not (stream.waiting or stream.final):  # done: its final has landed
                continue
            refresh = (
                stream.refreshed_at is None or now - stream.refreshed_at >= self._refresh_s or stream.final is not None
            )
            written = stream.gap_at if stream.gap_at is not None else stream.first_seq + len(stream.landed)
            append = Append(stream.reply_to, stream.entry_id, stream.waiting, stream.final_waiting, refresh, written)
            batch.append((stream, stream.oldest, stream.final))
            appends.append(append)
            stream.waiting, stream.final_waiting = [], None
        if not batch:
            return
        to_write = [append for append in appends if append.tokens or append.final]
        replies = await retrying(lambda: self.publisher.append(to_write)) if to_write else []
        landed = time.monotonic()
        each_reply = iter(replies)
        for (stream, oldest, final), append in zip(batch, appends):
            writes = bool(append.tokens or append.final)
            reply = next(each_reply) if writes else True
            if stream.result.done():
                continue  # closed while the pipeline was in flight
            if isinstance(reply, Gap):
                self._send_again(stream, append, reply.have)
            elif reply is True:
                stream.landed.extend(append.tokens)
                stream.gap_at = None
                if writes:
                    self.observe_lag(landed - oldest)
                if append.refresh_ttl:
                    stream.refreshed_at = landed
                if final is not None:
                    text = None if stream.text is None else "".join(stream.text)
                    num_tokens = stream.seq
                    stream.result.set_result(Published(final, num_tokens, text))
            elif reply is False:
                self._fail(stream, LeaseLost(stream.reply_to))
            else:
                self._fail(stream, reply)

    def _send_again(self, stream: _Stream, append: Append, have: int) -> None:
        """The stream holds `have` token events, fewer than landed: what was lost goes
        again, ahead of this append's events and of any that came since."""
        kept = max(0, have - stream.first_seq)
        lost = stream.landed[kept:]
        del stream.landed[kept:]
        if have < stream.first_seq:  # lost events this worker did not write (before it took the job over)
            log.error("reply_stream_gap", reply_to=stream.reply_to, missing=(have, stream.first_seq))
            stream.gap_at = have
        log.warning("reply_stream_repaired", reply_to=stream.reply_to, have=have, sent_again=len(lost))
        stream.waiting = [*lost, *append.tokens, *stream.waiting]
        if append.final is not None:
            stream.final_waiting = append.final
        self._ready.set()

    @staticmethod
    def _fail(stream: _Stream, error: BaseException) -> None:
        if not stream.result.done():
            stream.result.set_exception(error)
