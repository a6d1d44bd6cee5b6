"""The soak's chaos (`--soak-chaos`; docs/benchmarks.md, "With chaos"): faults at random
moments, one at a time, and streamed HTTP requests through two gateways that resume at the
other one when theirs dies. The faults: `worker_kill` (w1 SIGKILLed while it streams, then
restarted under its name); `worker_stop` (w1 SIGSTOPped 3-6 s: its leases run out, w2 takes
its jobs over and w1, continued, finds them fenced); `gateway_kill` (one SIGKILLed, back 2 s
later); `redis_restart` (SIGTERM, restarted on its append-only file); `redis_stall` (SIGSTOP
for 5 s: every connection stalls, as in a network partition). A Sentinel failover is drilled
on its own (tests/service/test_sentinel_failover.py).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.fleet import BACKPRESSURE_OFF, Fleet
from bench.http_client import ServerSentEvents
from bench.processes import GatewayProcess
from service.config import DEFAULT_MODEL_NAME
from service.gateway.resume import read_event_id

FAULTS = ("worker_kill", "worker_stop", "gateway_kill", "redis_restart", "redis_stall")
STOP_S = (3.0, 6.0)
REDIS_STALL_S = 5.0
GATEWAY_DOWN_S = 2.0
# A streamed request whose gateway died is resumed at a live gateway, for this long.
RESUME_FOR_S = 60.0


@dataclass
class HttpStream:
    """One streamed completion as its client saw it, across the connections it took."""

    request_id: str | None = None
    positions: list[tuple[int, int]] = field(default_factory=list)  # every event's, in arrival order
    done: bool = False  # `[DONE]` arrived
    resumed: int = 0  # connections that continued it after a break (Last-Event-ID or from its start)
    error: str | None = None  # an error answer (not a break)

    @property
    def duplicates(self) -> int:
        return len(self.positions) - len(set(self.positions))


class Gateways:
    """Two gateways on the soak's Redis, and an HTTP session (while entered) that sends each
    streamed request to one of those up."""

    def __init__(self, fleet: Fleet, rng: random.Random, ttl_s: int) -> None:
        flags = ["--reply-timeout-s", "120", *BACKPRESSURE_OFF]
        flags += ["--stream-ttl-s", str(ttl_s)]  # resumable as long as the workers keep reply streams
        self.processes = [fleet.gateway(name, *flags) for name in ("g1", "g2")]
        self.rng = rng
        self.streams: list[HttpStream] = []

    async def __aenter__(self) -> Gateways:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=150))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()

    async def kill_one(self) -> str:
        gateway = self.rng.choice(self.processes)
        gateway.process.kill()
        gateway.process.wait()
        await asyncio.sleep(GATEWAY_DOWN_S)
        gateway.start()
        await asyncio.to_thread(gateway.wait_ready)
        return gateway.name

    def _up(self) -> GatewayProcess:
        up = [g for g in self.processes if g.process is not None and g.process.poll() is None]
        return self.rng.choice(up or self.processes)

    async def stream(self, body: dict, on_request_id: Callable[[str], object]) -> HttpStream:
        """POST a streamed completion; when the connection breaks, continue it at a gateway
        that is up, after the last event id received (or from its start)."""
        import aiohttp

        record, last_id = HttpStream(), None
        self.streams.append(record)
        give_up = time.monotonic() + RESUME_FOR_S
        while time.monotonic() < give_up:
            gateway, headers = self._up(), {"X-Inflight-Event-Ids": "1"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            if record.request_id is None:
                method, path, json = "POST", "/v1/completions", body
            else:  # resumed: from the last event, or from the start when none came
                method, path, json = "GET", f"/v1/streams/{record.request_id}", None
            record.resumed += record.request_id is not None
            try:
                async with self.session.request(method, gateway.url + path, json=json, headers=headers) as response:
                    if response.status in (502, 503, 504):
                        await asyncio.sleep(0.5)  # the gateway cannot reach Redis yet: ask again
                        continue
                    if response.status != 200:
                        record.error = f"{response.status} {await response.text()}"[:200]
                        return record
                    if record.request_id is None:
                        record.request_id = response.headers["x-request-id"]
                        on_request_id(record.request_id)
                    parser = ServerSentEvents()
                    async for raw in response.content:
                        if (event := parser.feed(raw)) is None:
                            continue
                        event_id, data = event
                        if event_id is not None:
                            record.positions.append(read_event_id(event_id)[1])
                            last_id = event_id
                        if data == "[DONE]":
                            record.done = True
                            return record
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                pass  # the gateway died mid-answer (or before it): go on at one that is up
            await asyncio.sleep(0.2)
        return record

    def figures(self) -> dict:
        streams = self.streams
        return {
            "sent": len(streams),
            "completed": sum(s.done for s in streams),
            "errors": sum(s.error is not None for s in streams),
            "broken_without_resumption": sum(not s.done and s.error is None for s in streams),
            "resumed": sum(s.resumed > 0 for s in streams),
            "resumed_and_completed": sum(s.resumed > 0 and s.done for s in streams),
            "duplicate_events": sum(s.duplicates for s in streams),
            "out_of_order": sum(s.positions != sorted(s.positions) for s in streams),
            "error_samples": [s.error for s in streams if s.error][:5],
        }


def completion_body(prompt: str, options: dict) -> dict:
    """The soak's job as a streamed `POST /v1/completions`."""
    keep = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "priority")
    return {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "stream": True} | {
        k: options[k] for k in keep if k in options
    }


def pause(pid: int, seconds: float) -> asyncio.Task:
    """SIGSTOP the process now, SIGCONT it `seconds` later (the task)."""
    os.kill(pid, signal.SIGSTOP)

    async def resume() -> None:
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    return asyncio.get_running_loop().create_task(resume())
