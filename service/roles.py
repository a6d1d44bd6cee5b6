"""A worker's role in disaggregated prefill and decode (docs/features.md;
service/handoff.py has the handoff itself), chosen once at start (`role_for`):

- `Role` (`--role both`, the default) serves each job whole: read from the request
  stream, acked once its final event is out;
- `PrefillRole` serves a job up to its first token, then hands it to the decode pool:
  the engine stages the prompt's K/V, the worker adds a handoff entry, then acks;
- `DecodeRole` reads handoff entries instead: their job continues here from the
  published tokens, as a takeover does, with the prompt's K/V read from the prefill
  worker; when it ends here (whichever way) the prefill worker is told, and the K/V
  read are let go once the engine has.

The job runner (service/job_runner.py) asks the role the same questions at the same
steps, whatever the role.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from service.config import DisaggConfig, RedisConfig
from service.handoff import Handoff, Handoffs
from service.ingest import Entry
from service.metrics import Metrics
from service.outbox import Published
from service.protocol import Job, decode_job
from service.retry import retrying
from service.settling import Rejection, Settling
from workers.api import FinishReason
from workers.async_engine import AsyncEngine

if TYPE_CHECKING:
    import torch

Background = dict[str, Coroutine[Any, Any, None]]  # by task name


@dataclass(frozen=True)
class Assignment:
    """What a held entry asks of this worker: its job, and the request entry its reply
    stream belongs to (the entry itself; on a decode worker, the one its handoff names)."""

    job: Job
    owner: str
    handoff: Handoff | None = None  # on a decode worker


def reads_from(config: RedisConfig, disagg: DisaggConfig) -> RedisConfig:
    """The stream a worker of this role reads: a decode worker serves what prefill
    workers hand off."""
    if disagg.role == "decode":
        return replace(config, requests_stream=disagg.handoff_stream)
    return config


def role_for(
    disagg: DisaggConfig, settling: Settling, front: AsyncEngine, redis, config: RedisConfig, metrics: Metrics
) -> Role:
    if disagg.role == "prefill":
        return PrefillRole(settling, front, config, Handoffs(redis, disagg, config.consumer, metrics), disagg)
    if disagg.role == "decode":
        return DecodeRole(settling, front, config, Handoffs(redis, disagg, config.consumer, metrics))
    return Role(settling, front, config)


class Role:
    """Serves each job whole (`--role both`)."""

    # Prompts at least this long end with `handoff` after their first token (prefill only).
    handoff_min_prompt_tokens: int | None = None
    handoffs: Handoffs | None = None  # this worker's side of the handoffs (prefill, decode)

    def __init__(self, settling: Settling, front: AsyncEngine, config: RedisConfig) -> None:
        self.settling = settling
        self.front = front
        self.reply_prefixes = config.reply_prefixes

    def decode(self, entry: Entry) -> Assignment:
        """The entry's job; raises `ProtocolError` (or `ValueError`) for a bad entry."""
        return Assignment(decode_job(entry.entry_id, entry.fields, self.reply_prefixes), entry.entry_id)

    def background(self) -> Background:
        """Tasks that run beside the jobs while the worker serves."""
        return {}

    async def prompt_kv(self, entry: Entry, assignment: Assignment) -> torch.Tensor | None:
        """The prompt's K/V, when they were computed elsewhere."""
        return None

    async def settle(self, entry: Entry, assignment: Assignment, published: Published) -> None:
        """The job's final event is out: ack its entry (dead-letter it with its error)."""
        event = published.final
        if event.error_code is None:
            await self.settling.ack(entry)
            return
        rejection = Rejection(event.error_code.value, event.error or "", assignment.job.reply_to, published.num_tokens)
        await self.settling.reject(entry, rejection, claimed=True, owner=assignment.owner)

    async def ended(self, assignment: Assignment) -> None:
        """The job ended on this worker, whichever way (not lost, nor left)."""

    def let_go(self, entry: Entry) -> None:
        """The job's task is ending, whichever way."""


class _HandingOff(Role):
    """A role that takes part in handoffs: its transfer agent and arena kept up."""

    def __init__(self, settling: Settling, front: AsyncEngine, config: RedisConfig, handoffs: Handoffs) -> None:
        super().__init__(settling, front, config)
        self.handoffs: Handoffs = handoffs

    def background(self) -> Background:
        return {"handoffs": self._keep_handoffs()}

    async def _keep_handoffs(self) -> None:
        try:
            await retrying(self.handoffs.run)
        finally:
            await asyncio.shield(self.handoffs.close())


class PrefillRole(_HandingOff):
    """Serves a job up to its first token, then hands it to the decode pool."""

    def __init__(
        self, settling: Settling, front: AsyncEngine, config: RedisConfig, handoffs: Handoffs, disagg: DisaggConfig
    ) -> None:
        super().__init__(settling, front, config, handoffs)
        self.handoff_min_prompt_tokens = disagg.handoff_min_prompt_tokens
        front.stage_handoffs_in(handoffs.arena)

    async def settle(self, entry: Entry, assignment: Assignment, published: Published) -> None:
        event = published.final
        if event.error_code is not None or event.finish_reason is not FinishReason.HANDOFF:
            await super().settle(entry, assignment, published)  # a short prompt: served whole
            return
        self.settling.mark(entry)
        staged_tokens = self.front.take_staged(entry.entry_id)
        await retrying(lambda: self.handoffs.hand_off(self.settling.reader, entry, staged_tokens))


class DecodeRole(_HandingOff):
    """Continues the jobs prefill workers hand off, from the published tokens."""

    def decode(self, entry: Entry) -> Assignment:
        handoff = Handoff.of_entry(entry.fields)  # ValueError: not a handoff entry
        job = decode_job(handoff.origin, handoff.job_fields, self.reply_prefixes)
        return Assignment(job, handoff.origin, handoff)

    async def prompt_kv(self, entry: Entry, assignment: Assignment) -> torch.Tensor | None:
        assert assignment.handoff is not None
        return await self.handoffs.read(assignment.handoff, kv_slot(entry))

    async def ended(self, assignment: Assignment) -> None:
        """The prefill worker may free the prompt's K/V."""
        handoff = assignment.handoff
        assert handoff is not None
        await retrying(lambda: self.handoffs.confirm(handoff))

    def let_go(self, entry: Entry) -> None:
        """Free the K/V read for `entry` once the engine is done with the request (it
        places them in its prefix cache when it takes the request in: never before)."""
        slot = kv_slot(entry)
        self.front.released(entry.entry_id).add_done_callback(lambda _: self.handoffs.release(slot))


def kv_slot(entry: Entry) -> str:
    """The arena slot a decode worker reads a handed-off prompt into: one per delivery, so a
    job taken back reads afresh while the old slot waits for the engine to let it go."""
    return f"{entry.entry_id}#{entry.deliveries}"
