"""Errors as OpenAI shapes them, `{"error": {"message", "type", "param", "code"}}`, and
the HTTP status each of the queue's error codes (docs/protocol.md) is answered with."""

from __future__ import annotations

import json
import math

# A queue error code -> (HTTP status, OpenAI error type). docs/gateway.md, "Errors", is this table.
QUEUE_ERRORS: dict[str, tuple[int, str]] = {
    # The job itself was wrong: the client's to fix.
    "missing_field": (400, "invalid_request_error"),
    "unknown_field": (400, "invalid_request_error"),
    "invalid_type": (400, "invalid_request_error"),
    "invalid_field": (400, "invalid_request_error"),
    "malformed_payload": (400, "invalid_request_error"),
    "invalid_request": (400, "invalid_request_error"),  # the engine refused it, e.g. beyond the context
    "invalid_grammar": (400, "invalid_request_error"),  # its schema or regex does not compile
    "too_large": (413, "invalid_request_error"),
    # The worker that took the job has no such LoRA adapter (the registry listed it, so the
    # fleet disagrees): a 404, as for a `model` no one serves, which it is to this client.
    "unknown_adapter": (404, "invalid_request_error"),
    # Refused for load, before anything ran: the client's to send again after Retry-After.
    "queue_full": (429, "rate_limit_error"),
    "quota_exceeded": (429, "rate_limit_error"),
    # A worker with a length policy predicts it cannot end by its deadline_ms: nothing
    # ran, and another server (or a later deadline) may do.
    "deadline_unmeetable": (503, "server_error"),
    # The gateway names every job afresh, so this means two gateways drew one id.
    "duplicate_id": (409, "server_error"),
    # The serving side failed.
    "too_many_deliveries": (500, "server_error"),  # workers kept dying on this job
    "internal_error": (500, "server_error"),  # the model step failed
    "redis_error": (502, "server_error"),  # Redis refused a worker's command for this job
}


class APIError(Exception):
    """An error answer: HTTP status, OpenAI error type, message, and optionally the
    offending parameter and a code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_queue(code: str, message: str, retry_after_s: float | None = None) -> APIError:
    """A job's `error` event as the HTTP error it maps to (an unknown code is a 500). A
    refusal for load says when to come back: `Retry-After` in whole seconds, rounded up
    (so a client never returns early), at least 1."""
    status, type_ = QUEUE_ERRORS.get(code, (500, "server_error"))
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return APIError(status, message, type_, code=code, headers=headers)
