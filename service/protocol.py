"""The wire protocol (version 1): job entries in, reply entries out. See docs/protocol.md.

Pure functions over Redis field maps, no I/O. A request-stream entry is decoded into a
typed `Job` by `decode_job` (service/job.py, re-exported here), which raises
`ProtocolError` with a stable code; `token_fields`, `done_fields` and `error_fields`
build reply-stream entries.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack

from service.job import (
    ADAPTER_PATTERN,
    ADAPTER_RULE,
    DEFAULT_TENANT,
    FIELDS,
    MAX_ENTRY_BYTES,
    MAX_ID_CHARS,
    REPLY_PREFIX,
    TENANT_PATTERN,
    Job,
    ProtocolError,
    decode_job,
    hash_tag,
    reply_stream,
)
from workers.api import FinalEvent

__all__ = [
    "ADAPTER_PATTERN",
    "ADAPTER_RULE",
    "CONTROL_STREAM",
    "DEFAULT_TENANT",
    "FIELDS",
    "MAX_ENTRY_BYTES",
    "MAX_ID_CHARS",
    "REPLY_PREFIX",
    "REQUESTS_STREAM",
    "TENANT_PATTERN",
    "Job",
    "ProtocolError",
    "decode_job",
    "done_fields",
    "error_fields",
    "hash_tag",
    "reply_stream",
    "token_data",
    "token_fields",
]

REQUESTS_STREAM = "inflight:requests"
CONTROL_STREAM = "inflight:control"


def token_data(
    seq: int,
    text: str,
    token_ids: tuple[int, ...] | list[int],
    index: int | None = None,
    logprob: float | None = None,
    token: str | None = None,
    top_logprobs: tuple[tuple[int, str, float], ...] = (),
) -> bytes:
    """A token event's `data`: the event as msgpack. The worker sends only this; the
    write script derives the readable fields (`token_fields`) from it. `index` names
    the choice, for a request with n > 1 only; `logprob` and `top_logprobs` are there
    only for a request that asked for them (in `data` only)."""
    data = {"type": "token", "seq": seq, "text": text, "token_ids": list(token_ids)}
    if index is not None:
        data["index"] = index
    if logprob is not None:
        data["logprob"] = logprob
        data["token"] = token
        if top_logprobs:
            data["top_logprobs"] = [
                {"token_id": token_id, "token": text, "logprob": value} for token_id, text, value in top_logprobs
            ]
    return msgpack.packb(data)


def token_fields(
    seq: int, text: str, token_ids: tuple[int, ...] | list[int], index: int | None = None
) -> dict[str, str | bytes]:
    """One token event's entry: readable fields plus the same data as msgpack in `data`."""
    fields: dict[str, str | bytes] = {"type": "token", "seq": str(seq)}
    if index is not None:
        fields["index"] = str(index)
    fields.update(
        {"text": text, "token_ids": " ".join(map(str, token_ids)), "data": token_data(seq, text, token_ids, index)}
    )
    return fields


def done_fields(event: FinalEvent, worker: str = "") -> dict[str, str | bytes]:
    """The final event of a request that ended without error (stop, length, cancelled,
    deadline); `worker` names the consumer that finished it."""
    t = event.timings
    data: dict[str, Any] = {
        "type": "done",
        "finish_reason": event.finish_reason.value,
        "text": event.text,
        "usage": {"prompt_tokens": event.usage.prompt_tokens, "completion_tokens": event.usage.completion_tokens},
        "timings": {"queue_s": t.queue_s, "first_token_s": t.first_token_s, "total_s": t.total_s},
        "worker": worker,
    }
    fields: dict[str, str | bytes] = {
        "type": "done",
        "finish_reason": data["finish_reason"],
        "text": event.text,
        "prompt_tokens": str(event.usage.prompt_tokens),
        "completion_tokens": str(event.usage.completion_tokens),
        "queue_s": f"{t.queue_s:.6f}",
        "first_token_s": "" if t.first_token_s is None else f"{t.first_token_s:.6f}",
        "total_s": f"{t.total_s:.6f}",
        "worker": worker,
    }
    if event.choices:  # n > 1
        data["choices"] = [
            {
                "index": c.index,
                "finish_reason": c.finish_reason.value,
                "text": c.text,
                "completion_tokens": c.completion_tokens,
            }
            for c in event.choices
        ]
        fields["choices"] = json.dumps(data["choices"])
    fields["data"] = msgpack.packb(data)
    return fields


def error_fields(code: str, message: str, retry_after_s: float | None = None) -> dict[str, str | bytes]:
    """An error event; a refusal for load says when to try again (`retry_after_s`)."""
    data: dict = {"type": "error", "code": code, "message": message}
    fields: dict[str, str | bytes] = {"type": "error", "code": code, "message": message}
    if retry_after_s is not None:
        data["retry_after_s"] = retry_after_s
        fields["retry_after_s"] = f"{retry_after_s:g}"
    fields["data"] = msgpack.packb(data)
    return fields
