"""A batch's lines in OpenAI's shapes: the input file's requests, checked before anything
runs, and the lines of the output and error files.

An input line is `{"custom_id", "method": "POST", "url", "body"}`, its url the batch's
endpoint and its custom_id unique in the file. A file with any line otherwise fails the
whole batch (status `failed`, its `errors` naming each line, up to MAX_LISTED_ERRORS);
a body the API would refuse fails that request alone, later, as its HTTP request would.
"""

from __future__ import annotations

import json

from service.gateway.errors import APIError
from service.gateway.openai_api import CHAT, TEXT

# A batch's endpoint -> the API its bodies are read as.
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT}
MAX_LISTED_ERRORS = 100
MAX_CUSTOM_ID_CHARS = 512

# Why a request that never ran failed: the batch ended first (OpenAI's codes).
CANCELLED, EXPIRED = "batch_cancelled", "batch_expired"
ENDED_MESSAGES = {
    CANCELLED: "This request was not run: the batch was cancelled.",
    EXPIRED: "This request could not be run before the batch's completion window ended.",
}


def check_input(content: bytes, endpoint: str) -> tuple[list[str], list[dict]]:
    """The file's requests (each line's text, blank lines skipped), and its problems as
    OpenAI's batch errors (`line` counts from 1, blank lines included)."""
    requests: list[str] = []
    errors: list[dict] = []
    seen: set[str] = set()
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return [], [_error("invalid_file", "the file is not UTF-8 text", None, None)]
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        problem = _problem(line, endpoint, seen)
        if problem is None:
            requests.append(line)
        elif len(errors) < MAX_LISTED_ERRORS:
            errors.append(_error(*problem, number))
    if not requests and not errors:
        errors.append(_error("empty_file", "the file holds no requests", None, None))
    return requests, errors


def _problem(line: str, endpoint: str, seen: set[str]) -> tuple[str, str, str | None] | None:
    """(code, message, param) of what is wrong with one line, or None."""
    try:
        item = json.loads(line)
    except ValueError:
        return "invalid_json_line", "the line is not valid JSON", None
    if not isinstance(item, dict):
        return "invalid_json_line", "the line must be a JSON object", None
    for name in ("custom_id", "method", "url", "body"):
        if name not in item:
            return "missing_required_parameter", f"the line has no `{name}`", name
    custom_id = item["custom_id"]
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        return "invalid_custom_id", f"custom_id must be a string of 1-{MAX_CUSTOM_ID_CHARS} characters", "custom_id"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id `{custom_id}` is on an earlier line too", "custom_id"
    seen.add(custom_id)
    if item["method"] != "POST":
        return "invalid_method", "method must be `POST`", "method"
    if item["url"] != endpoint:
        return "mismatched_endpoint", f"url must be the batch's endpoint, `{endpoint}`", "url"
    if not isinstance(item["body"], dict):
        return "invalid_body", "body must be a JSON object", "body"
    return None


def _error(code: str, message: str, param: str | None, line: int | None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


# -- output --------------------------------------------------------------------------------


def line_id(batch_id: str, line: int) -> str:
    """The `id` of a request's output line: OpenAI's `batch_req_` prefix."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def answered(batch_id: str, line: int, custom_id: str, request_id: str, body: dict) -> str:
    """An output file line: the request's 200 answer."""
    return _line(batch_id, line, custom_id, {"status_code": 200, "request_id": request_id, "body": body}, None)


def refused(batch_id: str, line: int, custom_id: str, request_id: str | None, error: APIError) -> str:
    """An error file line: the error answer the request's HTTP request would have had."""
    response = {"status_code": error.status, "request_id": request_id, "body": error.body()}
    return _line(batch_id, line, custom_id, response, None)


def ended(batch_id: str, line: int, custom_id: str, code: str) -> str:
    """An error file line: a request that did not run (or was stopped) as its batch ended."""
    return _line(batch_id, line, custom_id, None, {"code": code, "message": ENDED_MESSAGES[code]})


def _line(batch_id: str, line: int, custom_id: str, response: dict | None, error: dict | None) -> str:
    return json.dumps(
        {"id": line_id(batch_id, line), "custom_id": custom_id, "response": response, "error": error},
        separators=(",", ":"),
    )
