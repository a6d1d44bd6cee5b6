"""A worker's side of the LoRA adapters at the edge (service/adapters.py): it lists the
adapters its engine serves in the stream's registry at start, and loads those the control
stream asks for, each off the event loop (an adapter is files to read and check), one
log line each way. A bad adapter, or a worker without multi-LoRA, changes nothing: the
worker serves on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog
from redis.exceptions import RedisError

from service.adapters import check_name, registry_key
from service.cancels import stream_id
from service.metrics import Metrics
from service.retry import retrying
from service.text import text
from workers.engine import Engine

log = structlog.get_logger("inflight.worker")


class AdapterLoader:
    def __init__(self, redis, requests_stream: str, engine: Engine, metrics: Metrics) -> None:
        self.redis = redis
        self.key = registry_key(requests_stream)
        self.engine = engine
        self.metrics = metrics
        self._loading: set[asyncio.Task] = set()  # kept referenced until done
        self._last_entry = (0, 0)  # the newest control entry taken up

    async def publish_loaded(self) -> None:
        """List the adapters the engine loaded at start (its `--lora-dir`'s) in the registry."""
        lora_dir = self.engine.config.lora.lora_dir
        names = self.engine.adapters
        self.metrics.adapters_loaded.set(len(names))
        if lora_dir is not None and names:
            await retrying(lambda: self.redis.hset(self.key, mapping={n: str(Path(lora_dir) / n) for n in names}))

    def request(self, entry_id: bytes | str, fields: dict) -> None:
        """A `load_adapter` control entry (fields as bytes): load it in a task of its own,
        once (the control loop and a catch-up may both read an entry)."""
        if stream_id(text(entry_id)) <= self._last_entry:
            return
        self._last_entry = stream_id(text(entry_id))
        # Not UTF-8: the name fails its check and the load is logged, not the control loop stopped.
        name, path = (text(fields.get(key, b""), errors="replace") for key in (b"name", b"path"))
        task = asyncio.get_running_loop().create_task(self._load(name, path), name=f"load-adapter-{name}")
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)

    async def _load(self, name: str, path: str) -> None:
        started = time.perf_counter()
        try:
            check_name(name)
            if not path:
                raise ValueError("the message gives no path")
            await asyncio.to_thread(self.engine.load_adapter, name, path)
        except Exception as error:  # BadAdapter, multi-LoRA off, a folder not there: one line, serve on
            self.metrics.observe_adapter_load(False, 0.0, len(self.engine.adapters))
            log.error("adapter_not_loaded", adapter=name, path=path, error=f"{error}" or type(error).__name__)
            return
        seconds = time.perf_counter() - started
        self.metrics.observe_adapter_load(True, seconds, len(self.engine.adapters))
        log.info("adapter_loaded", adapter=name, path=path, seconds=round(seconds, 3))
        try:
            await retrying(lambda: self.redis.hset(self.key, name, path))
        except RedisError as error:  # it serves the adapter; only the gateway does not know yet
            log.warning("adapter_not_listed", adapter=name, error=str(error))
