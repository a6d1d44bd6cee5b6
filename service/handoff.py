"""Disaggregated prefill and decode over the queue: how a job passes from a prefill worker
to a decode worker, and its prompt's K/V with it (docs/features.md).

A prefill worker serves a job from the request stream up to its first token, which it
publishes; the engine stages the prompt's full KV blocks in its handoff arena. The
worker then adds a **handoff entry** to the handoff stream, and only after that acks and
deletes the request entry (two steps, as a dead letter is: on a Redis Cluster the two
streams may live on different shards). A crash between them leaves the request entry
pending: another prefill worker takes it over, continues from the published token, and
hands it off again; the two decode workers that may then claim the reply stream are
fenced by its owner key like any takeover, so no token is written twice.

The handoff entry holds `origin` (the request entry's id: the reply stream's owner key
names it, so the decode worker's claim takes the stream over from the prefill worker),
`job` (the request entry's fields, msgpack) and, when K/V were staged, `kv` (msgpack:
the prefill worker's transfer agent, the slot's address and size, the tokens it holds,
its layout, and when the prefill worker frees it). A decode worker reads it through the
same consumer group, leases and takeovers as the request stream. It reads the K/V with
the transfer engine (`gpu/kv_transfer.py`) into a slot of its own arena, gives them to
the engine (they enter its prefix cache, as cached device blocks), and continues the job from the
published tokens, as a takeover does. When the job ends it tells the prefill worker,
which frees the slot; a slot never confirmed is freed `handoff_hold_s` after the
handoff. A decode worker taken over from keeps nothing: its successor reads the K/V from
the prefill worker again while they are held, and otherwise computes the prompt.

A transfer agent publishes what a peer needs to reach it (NIXL's agent metadata) under
`<handoff_stream>:agent:<name>`, refreshed while it runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgpack
import structlog
import torch

from gpu.kv_transfer import HandoffArena, KVTransferAgent, TransferFailed, transfer_available
from service.config import DisaggConfig
from service.metrics import Metrics
from service.text import text

log = structlog.get_logger("inflight.handoff")

# A decode worker reads a slot only while it has this long left before the prefill worker
# frees it (clocks on two hosts differ a little; a read takes milliseconds).
READ_MARGIN_S = 2.0
# How often the prefill side looks for confirmations and expired slots.
POLL_S = 0.02
# The agent's metadata key lives this long unless refreshed.
AGENT_TTL_S = 60


@dataclass(frozen=True)
class StagedKV:
    """Where a handed-off prompt's K/V wait on the prefill worker."""

    agent: str
    address: int
    num_bytes: int
    num_tokens: int
    shape: tuple[int, ...]
    dtype: str
    expires_at: float  # unix seconds: freed then, unless confirmed sooner

    def pack(self) -> bytes:
        return msgpack.packb(
            [self.agent, self.address, self.num_bytes, self.num_tokens, self.shape, self.dtype, self.expires_at]
        )

    @classmethod
    def unpack(cls, data: bytes) -> StagedKV:
        agent, address, num_bytes, num_tokens, shape, dtype, expires_at = msgpack.unpackb(data)
        return cls(agent, address, num_bytes, num_tokens, tuple(shape), dtype, expires_at)


@dataclass(frozen=True)
class Handoff:
    """A handoff entry, decoded."""

    origin: str  # the request entry's id
    job_fields: dict
    kv: StagedKV | None

    @classmethod
    def of_entry(cls, fields: dict) -> Handoff:
        """Raises ValueError for an entry that is not a handoff."""
        raw = {text(k): v for k, v in fields.items()}
        try:
            origin = text(raw["origin"])
            job_fields = msgpack.unpackb(raw["job"], raw=True)
            kv = StagedKV.unpack(raw["kv"]) if raw.get("kv") else None
        except (KeyError, ValueError, TypeError, msgpack.ExtraData) as error:
            raise ValueError(f"not a handoff entry: {type(error).__name__}: {error}") from error
        if not isinstance(job_fields, dict):
            raise ValueError("not a handoff entry: its job is not a map of fields")
        return cls(origin, job_fields, kv)


class Handoffs:
    """One worker's side of the handoffs: its transfer agent and arena, and the Redis writes."""

    def __init__(self, redis, config: DisaggConfig, consumer: str, metrics: Metrics) -> None:
        self.redis = redis
        self.config = config
        self.metrics = metrics
        self.agent: KVTransferAgent | None = None
        if transfer_available():
            self.agent = KVTransferAgent(f"{consumer}-{uuid.uuid4().hex[:8]}")
        else:  # no transfer engine installed: handoffs carry no K/V, decode workers compute prompts
            log.warning("kv_transfer_unavailable", hint="pip install 'inflight-llm[disagg]'")
        self.arena = HandoffArena(self.agent, config.handoff_memory_bytes, config.handoff_hold_s)
        self._peers: dict[str, str] = {}  # agent name -> connected peer name

    def agent_key(self, name: str) -> str:
        return f"{self.config.handoff_stream}:agent:{name}"

    # -- the prefill side --------------------------------------------------------------

    async def hand_off(self, reader, entry, staged_tokens: int) -> None:
        """Put the job of request entry `entry` on the handoff stream, then ack it there."""
        handoff = {"origin": entry.entry_id, "job": msgpack.packb(entry.fields)}
        if staged_tokens and self.agent is not None:
            slot = self.arena.view(entry.entry_id)
            handoff["kv"] = StagedKV(
                self.agent.name,
                self.arena.address(entry.entry_id),
                self.arena.slot_bytes(entry.entry_id),
                staged_tokens,
                tuple(slot.shape),
                str(slot.dtype).removeprefix("torch."),
                time.time() + self.config.handoff_hold_s,
            ).pack()
        else:
            self.arena.release(entry.entry_id)
        await self.redis.xadd(self.config.handoff_stream, handoff)
        await reader.ack(entry.entry_id)
        self.metrics.observe_handoff("handed_off")

    async def run(self) -> None:
        """Keep a prefill worker's agent reachable; free the slots confirmed or expired."""
        published_at = 0.0
        while True:
            now = time.monotonic()
            self.metrics.handoff_kv_held.set(self.arena.bytes_held)
            if self.agent is not None and self.config.role == "prefill":
                if now - published_at > AGENT_TTL_S / 3:
                    await self.redis.set(self.agent_key(self.agent.name), self.agent.metadata, ex=AGENT_TTL_S)
                    published_at = now
                for _, message in self.agent.notifications():
                    self.arena.release(message.decode())
            for handoff_id in self.arena.expire(now):
                log.info("handoff_expired", entry_id=handoff_id)
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        if self.agent is not None:
            await self.redis.delete(self.agent_key(self.agent.name))
            self.agent.close()

    # -- the decode side ---------------------------------------------------------------

    async def read(self, handoff: Handoff, slot_id: str) -> torch.Tensor | None:
        """The prompt's K/V, read from the prefill worker into this worker's arena under
        `slot_id` (released with `done`); None when they cannot be had: the prompt is
        computed instead."""
        kv, agent = handoff.kv, self.agent
        try:
            into = await self._read(kv, agent, slot_id) if kv is not None and agent is not None else None
        except TransferFailed as error:
            log.warning("kv_transfer_failed", entry_id=handoff.origin, error=str(error))
            self.arena.release(slot_id)
            self.metrics.observe_handoff("kv_failed")
            return None
        if into is None:
            self.metrics.observe_handoff("kv_computed")
        return into

    async def _read(self, kv: StagedKV, agent: KVTransferAgent, slot_id: str) -> torch.Tensor | None:
        if time.time() > kv.expires_at - READ_MARGIN_S:
            return None
        peer = await self._peer(agent, kv.agent)
        if peer is None:
            return None
        dtype = getattr(torch, str(kv.dtype), None)
        if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n > 0 for n in kv.shape):
            return None
        into = self.arena.reserve(slot_id, kv.shape, dtype, time.monotonic())
        if into is None:
            return None
        started = time.perf_counter()
        await asyncio.to_thread(agent.read, peer, kv.address, into)
        self.metrics.observe_handoff("kv_read", kv.num_bytes, time.perf_counter() - started)
        return into

    def release(self, slot_id: str) -> None:
        """This worker is done with the K/V it read under `slot_id` (the engine holds
        them in its prefix cache now, or the job ended or left)."""
        self.arena.release(slot_id)

    async def confirm(self, handoff: Handoff) -> None:
        """The job ended on this worker: the prefill worker may free the prompt's K/V. Never
        sent for a job this worker lost or left: its successor may still read them."""
        kv, agent = handoff.kv, self.agent
        peer = await self._peer(agent, kv.agent) if kv is not None and agent is not None else None
        if peer is not None and agent is not None:
            try:
                agent.notify(peer, handoff.origin.encode())
            except TransferFailed as error:  # the prefill worker frees it when the hold runs out
                log.warning("handoff_confirm_failed", entry_id=handoff.origin, error=str(error))

    async def _peer(self, transfer: KVTransferAgent, agent: str) -> str | None:
        """A prefill worker's agent, connected once through `transfer` (this worker's);
        None when it is gone or unreachable."""
        peer = self._peers.get(agent)
        if peer is None:
            metadata = await self.redis.get(self.agent_key(agent))
            if metadata is None:  # that prefill worker is gone
                return None
            try:
                peer = self._peers[agent] = transfer.connect(metadata)
            except TransferFailed as error:
                log.warning("kv_peer_unreachable", agent=agent, error=str(error))
                return None
        return peer
