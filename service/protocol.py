"""The wire protocol (version 1): job entries in, reply entries out. See docs/protocol.md.

Pure functions over Redis field maps, no I/O: `decode_job` turns a request-stream entry
into a `Job` or raises `ProtocolError` with a stable code; `token_fields`, `done_fields`
and `error_fields` build reply-stream entries. A job is either flat string fields (what
`redis-cli XADD` writes) or one `payload` field holding a msgpack map of the same fields.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import msgpack

from workers.api import PRIORITY_MAX, PRIORITY_MIN, FinalEvent, SamplingParams

REQUESTS_STREAM = "inflight:requests"
CONTROL_STREAM = "inflight:control"
REPLY_PREFIX = "inflight:out:"
# Largest accepted entry: prompt, messages and everything else together.
MAX_ENTRY_BYTES = 1 << 20
MAX_ID_CHARS = 200
DEFAULT_TENANT = "default"
# A tenant names Redis keys and metric labels: a short, plain name.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,64}")

FIELDS = frozenset(
    {
        "id",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "n",
        "priority",
        "deadline_ms",
        "reply_to",
        "json_schema",
        "json_object",
        "regex",
        "choice",
        "logprobs",
        "top_logprobs",
        "tenant",
        "batch",
    }
)
FLAT_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def reply_stream(request_id: str) -> str:
    """The default reply stream; `{id}` is a Redis Cluster hash tag, so all of one
    request's keys live in one slot."""
    return f"{REPLY_PREFIX}{{{request_id}}}"


class ProtocolError(ValueError):
    """A job entry that cannot be served. `code` is stable; `message` is for humans.

    `request_id` and `reply_to` are set when they could be read, so the error can be
    published where the producer listens.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply_to = reply_to


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: str | list[dict]
    params: SamplingParams
    priority: int
    deadline_ms: int | None
    reply_to: str
    tenant: str = DEFAULT_TENANT
    batch: bool = False


def decode_job(entry_id: str, fields: dict, reply_prefixes: tuple[str, ...] = (REPLY_PREFIX,)) -> Job:
    """A request-stream entry (field names and values as bytes or str) -> a `Job`.
    `reply_to` must start with one of `reply_prefixes`."""
    entry_id = _text(entry_id, "entry id")
    raw = {_text(k, "field name"): v for k, v in fields.items()}
    size = sum(len(k) + len(v if isinstance(v, (bytes, str)) else b"") for k, v in raw.items())
    if size > MAX_ENTRY_BYTES:
        raise ProtocolError("too_large", f"entry is {size} bytes; the limit is {MAX_ENTRY_BYTES}")
    if "payload" in raw:
        if len(raw) > 1:
            raise ProtocolError("invalid_field", "an entry with `payload` must have no other fields")
        values, typed = _unpack(raw["payload"]), True
    else:
        values, typed = {k: _text(v, k) for k, v in raw.items()}, False

    request_id = values.get("id", entry_id)
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_CHARS:
        raise ProtocolError("invalid_field", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    reply_to = values.get("reply_to", reply_stream(request_id))
    if not isinstance(reply_to, str) or not reply_to.startswith(reply_prefixes):
        raise ProtocolError(
            "invalid_field", f"reply_to must be a key starting with {' or '.join(reply_prefixes)}", request_id
        )
    if ("{" in reply_to or "}" in reply_to) and not hash_tag(reply_to):
        # Its owner key could not share its Redis Cluster slot.
        raise ProtocolError(
            "invalid_field",
            "braces in reply_to (or in the id it defaults to) must enclose a "
            "Redis Cluster hash tag, as in inflight:out:{job-1}",
            request_id,
        )

    def fail(code: str, message: str) -> ProtocolError:
        return ProtocolError(code, message, request_id, reply_to)

    unknown = sorted(set(values) - FIELDS)
    if unknown:
        raise fail("unknown_field", f"unknown field(s): {', '.join(unknown)}")
    if ("prompt" in values) == ("messages" in values):
        raise fail(
            "missing_field" if "prompt" not in values else "invalid_field",
            "give exactly one of `prompt` and `messages`",
        )
    if "prompt" in values:
        prompt = values["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise fail("invalid_field", "prompt must be a non-empty string")
    else:
        prompt = values["messages"] if typed else _json(values["messages"], "messages", fail)
        if not (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            raise fail("invalid_field", "messages must be a non-empty list of {role, content} string maps")

    def number(name: str, kind: type, default):
        if name not in values:
            return default
        value = values[name]
        if not typed:
            try:
                value = kind(value)
            except ValueError:
                raise fail("invalid_type", f"{name} must be {'an integer' if kind is int else 'a number'}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise fail("invalid_type", f"{name} must be {'an integer' if kind is int else 'a number'}")
        if kind is float and not math.isfinite(value):
            raise fail("invalid_field", f"{name} must be finite")
        return value

    stop = values.get("stop", [])
    if not typed and "stop" in values:
        stop = _json(stop, "stop", fail) if stop.startswith("[") else [stop]
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise fail("invalid_field", "stop must be a string or a list of non-empty strings")

    def boolean(name: str) -> bool:
        value = values.get(name, False)
        if not typed and name in values:
            value = FLAT_BOOLEANS.get(value.lower(), value)
        if not isinstance(value, bool):
            raise fail("invalid_type", f"{name} must be true or false")
        return value

    ignore_eos = boolean("ignore_eos")
    json_schema = values.get("json_schema")
    if not typed and json_schema is not None:
        json_schema = _json(json_schema, "json_schema", fail)
    if json_schema is not None and not isinstance(json_schema, (dict, bool)):
        raise fail("invalid_type", "json_schema must be a JSON schema: an object (JSON text in the flat form)")
    regex = values.get("regex")
    if regex is not None and not isinstance(regex, str):
        raise fail("invalid_type", "regex must be a string")
    choice = values.get("choice")
    if not typed and choice is not None:
        choice = _json(choice, "choice", fail)
    if choice is not None and not (isinstance(choice, list) and all(isinstance(c, str) for c in choice)):
        raise fail("invalid_type", "choice must be a list of strings (a JSON array in the flat form)")

    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=number("max_tokens", int, defaults.max_tokens),
        temperature=float(number("temperature", float, defaults.temperature)),
        top_k=number("top_k", int, defaults.top_k),
        top_p=float(number("top_p", float, defaults.top_p)),
        seed=number("seed", int, None),
        stop=tuple(stop),
        ignore_eos=ignore_eos,
        n=number("n", int, defaults.n),
        json_schema=json_schema,
        json_object=boolean("json_object"),
        regex=regex,
        choice=None if choice is None else tuple(choice),
        logprobs=boolean("logprobs"),
        top_logprobs=number("top_logprobs", int, defaults.top_logprobs),
    )
    try:
        params.validate()
    except ValueError as error:
        raise fail("invalid_field", str(error)) from None
    priority = number("priority", int, 0)
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise fail("invalid_field", f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    deadline_ms = number("deadline_ms", int, None)
    if deadline_ms is not None and deadline_ms < 0:
        raise fail("invalid_field", "deadline_ms must be a unix time in milliseconds")
    tenant = values.get("tenant", DEFAULT_TENANT)
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise fail("invalid_field", "tenant must be 1-64 characters of letters, digits and _ . @ -")
    return Job(request_id, prompt, params, priority, deadline_ms, reply_to, tenant, boolean("batch"))


# -- replies ---------------------------------------------------------------------------


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
    data = {
        "type": "done",
        "finish_reason": event.finish_reason.value,
        "text": event.text,
        "usage": {"prompt_tokens": event.usage.prompt_tokens, "completion_tokens": event.usage.completion_tokens},
        "timings": {"queue_s": t.queue_s, "first_token_s": t.first_token_s, "total_s": t.total_s},
        "worker": worker,
    }
    fields = {
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


def hash_tag(key: str) -> str:
    """The part of `key` that Redis Cluster hashes when it is not the whole key: the text
    between the first `{` and the next `}`, if not empty ("" when there is none)."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else ""


# -- helpers ---------------------------------------------------------------------------


def _text(value, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("invalid_type", f"{name} is not UTF-8") from None
    raise ProtocolError("invalid_type", f"{name} must be a string")


def _unpack(payload) -> dict:
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogateescape")
    try:
        values = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several types for bad input
        raise ProtocolError("malformed_payload", f"payload is not valid msgpack: {type(error).__name__}") from None
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ProtocolError("malformed_payload", "payload must be a msgpack map with string keys")
    if "payload" in values:
        raise ProtocolError("unknown_field", "unknown field(s): payload")
    return values


def _json(text: str, name: str, fail):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nesting deeper than the parser's stack
        raise fail("invalid_type", f"{name} must be JSON in the flat form") from None
