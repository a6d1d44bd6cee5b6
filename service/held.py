"""The entries a worker holds: each request-stream entry it read and has not let go of,
by entry id, with the task serving it. The claim loop adds them, each job's runner fills
them in, lease renewals and cancels look them up, and settling marks them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Held:
    """A request-stream entry this worker holds, and the task serving it."""

    task: asyncio.Task
    request_id: str | None = None  # known once the entry is decoded
    submitted: bool = False  # in the engine, under the entry id
    settling: bool = False  # being acked or dead-lettered: renewals no longer find it
    batch: bool = False  # a batch job (known once decoded)


# By entry id, in the order they were taken.
HeldEntries = dict[str, Held]
