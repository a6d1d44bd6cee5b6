"""The control stream's cancels, for the jobs a worker holds (service/cancels.py says
which job a cancel applies to): read back at start, caught up before jobs just read
start, followed while serving, and applied to the held jobs already in the engine.

Its `load_adapter` entries (service/adapters.py) go to the worker's adapter loader as
they come while serving; those sent before the worker started are not read back (its
`--lora-dir` is what it serves from the start)."""

from __future__ import annotations

from service.adapter_loader import AdapterLoader
from service.adapters import LOAD_ADAPTER
from service.cancels import CancelRegistry, stream_id
from service.config import RedisConfig
from service.held import HeldEntries
from service.retry import retrying
from workers.async_engine import AsyncEngine


class Control:
    def __init__(
        self,
        redis,
        config: RedisConfig,
        cancels: CancelRegistry,
        held: HeldEntries,
        front: AsyncEngine,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self.redis = redis
        self.stream = config.control_stream
        self.block_ms = config.block_ms
        self.cancels = cancels
        self.held = held
        self.front = front
        self.adapters = adapters

    async def load(self) -> None:
        """The cancels of the last `cancel_ttl_s`, from the control stream."""
        start = self.cancels.window_start()
        while entries := await self.redis.xrange(self.stream, min=start, count=1000):
            self.cancels.add_entries(entries)
            start = f"({self.cancels.last_id}"
        self.cancels.last_id = max(self.cancels.last_id, self.cancels.window_start(), key=stream_id)

    async def catch_up(self) -> None:
        """Take in cancels sent up to now, before starting jobs just read."""
        entries = await self.redis.xrange(self.stream, min=f"({self.cancels.last_id}")
        self._apply(entries)

    async def follow(self) -> None:
        """Apply each cancel as it comes, until cancelled."""
        while True:
            reply = await retrying(
                lambda: self.redis.xread({self.stream: self.cancels.last_id}, block=self.block_ms, count=1000)
            )
            for _, entries in reply or []:
                self._apply(entries)

    def _apply(self, entries: list) -> None:
        if self.adapters is not None:
            for entry_id, fields in entries:
                if fields.get(b"type") == LOAD_ADAPTER.encode():
                    self.adapters.request(entry_id, fields)
        for request_id in self.cancels.add_entries(entries):
            for entry_id, held in self.held.items():
                if held.request_id == request_id and held.submitted and self.cancels.cancels(request_id, entry_id):
                    self.front.cancel(entry_id)
