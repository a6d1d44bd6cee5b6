"""Cancellation anywhere: what the control stream has asked to cancel, remembered.

A producer cancels with `XADD inflight:control * type cancel id <request id>`. The cancel
applies to every job with that id whose request entry is not newer than the cancel entry
(both ids are times on one Redis clock, in milliseconds: a job submitted in the same
millisecond as the cancel counts as before it), wherever the job is: running or queued in a
worker, waiting in the stream, in the middle of a takeover, or not yet read by any worker.
A job submitted after the cancel is not affected.

Each worker keeps the cancels of the last `ttl_s` in memory: it reads them back from the
control stream when it starts, follows the stream, and catches up before it starts the
jobs it has just read. The control stream itself is trimmed to the same window.
"""

from __future__ import annotations

import time

from service.text import text


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable (milliseconds, sequence) pair."""
    millis, _, sequence = entry_id.partition("-")
    return int(millis), int(sequence or 0)


class CancelRegistry:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.last_id = "0-0"  # the newest control entry seen
        self._cancels: dict[str, tuple[int, int]] = {}  # request id -> its newest cancel

    def window_start(self, now_s: float | None = None) -> str:
        """The oldest control entry id still remembered."""
        return f"{int(((now_s or time.time()) - self.ttl_s) * 1000)}-0"

    def add_entries(self, entries) -> list[str]:
        """Take in control-stream entries (id, fields); returns the request ids cancelled."""
        cancelled = []
        for entry_id, fields in entries:
            entry_id = text(entry_id)
            if stream_id(entry_id) > stream_id(self.last_id):
                self.last_id = entry_id
            request_id = fields.get(b"id")
            if fields.get(b"type") == b"cancel" and request_id:
                request_id = request_id.decode(errors="replace")
                self._cancels[request_id] = max(self._cancels.get(request_id, (0, 0)), stream_id(entry_id))
                cancelled.append(request_id)
        return cancelled

    def cancels(self, request_id: str, job_entry_id: str) -> bool:
        """Whether a cancel sent after this job was submitted (or in the same
        millisecond) is remembered."""
        cancel = self._cancels.get(request_id)
        return cancel is not None and stream_id(job_entry_id)[0] <= cancel[0]

    def forget_expired(self, now_s: float | None = None) -> None:
        oldest = stream_id(self.window_start(now_s))
        self._cancels = {rid: at for rid, at in self._cancels.items() if at >= oldest}
